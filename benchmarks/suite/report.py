"""Render benchmark result JSON files into docs/PERFORMANCE.md tables and PNG plots.

python benchmarks/suite/report.py benchmarks/results/<run>/*.json --plots docs/img
Prints Markdown to stdout; the hand-written parts of PERFORMANCE.md embed it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _fmt(value: object, digits: int = 2) -> str:
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return "" if value is None else str(value)


def table(rows: list[dict], columns: list[tuple[str, str]]) -> str:
    head = "| " + " | ".join(title for title, _ in columns) + " |"
    rule = "|" + "|".join("---" for _ in columns) + "|"
    body = []
    for row in rows:
        cells = []
        for _, key in columns:
            value = row.get(key)
            if key == "fraction_of_floor" and isinstance(value, float):
                cells.append(f"{value:.0%}")
            else:
                cells.append(_fmt(value))
        body.append("| " + " | ".join(cells) + " |")
    return "\n".join([head, rule, *body])


def plot_batch(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    shapes = sorted({r["name"].split("/")[1] for r in rows})
    for color, shape in zip(("tab:blue", "tab:red", "tab:green"), shapes):
        mine = [r for r in rows if r["name"].split("/")[1] == shape]
        sizes = [r["batch"] for r in mine]
        ax.plot(sizes, [r["tok_per_s"] for r in mine], "o-", color=color, label=f"tokenmill {shape}")
        ax.plot(sizes, [r["batch"] / r["floor_ms"] * 1e3 for r in mine], "--", color=color, label=f"floor {shape}")
        peers = [r for r in mine if "peer_transformers_tok_per_s" in r]
        if peers:
            ax.plot([r["batch"] for r in peers], [r["peer_transformers_tok_per_s"] for r in peers], "x:",
                    color=color, label=f"transformers {shape}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch size (sequences decoding together)")
    ax.set_ylabel("output tokens / s")
    ax.set_title("Static batched decode on H200 (bf16, context 128)")
    ax.legend(fontsize=7)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("files", nargs="+")
    parser.add_argument("--plots", default=None, help="folder for PNG plots")
    args = parser.parse_args()
    rows = []
    for name in args.files:
        rows += json.loads(Path(name).read_text())["rows"]
    by = lambda prefix: [r for r in rows if r["name"].startswith(prefix)]  # noqa: E731
    decode_cols = [("name", "name"), ("ms/step", "ms_per_step"), ("tok/s", "tok_per_s"), ("floor ms", "floor_ms"),
                   ("of floor", "fraction_of_floor")]
    print("### Latency (batch 1)\n")
    print(table(by("latency/"), decode_cols + [("transformers ms/step", "peer_transformers_ms_per_step")]))
    print("\n### Static batched decode\n")
    print(table(by("batch/"), decode_cols + [("speedup vs 1", "speedup_over_one_stream"),
                                             ("transformers tok/s", "peer_transformers_tok_per_s")]))
    print("\n### Offline throughput (standard workload)\n")
    thr = by("throughput/")
    for r in thr:
        peer = r.get("peer_transformers_generate_batch", {})
        r["peer_tok_per_s"] = peer.get("output_tok_per_s")
    print(table(thr, [("name", "name"), ("s", "seconds"), ("output tok/s", "output_tok_per_s"),
                      ("total tok/s", "total_tok_per_s"), ("floor s", "floor_seconds"),
                      ("of floor", "fraction_of_floor"), ("transformers generate_batch tok/s", "peer_tok_per_s"),
                      ("speedup", "speedup_over_peer")]))
    print("\n### Features on and off\n")
    for r in by("features/"):
        print(f"- `{r['name']}`: " + ", ".join(f"{k}={_fmt(v)}" for k, v in r.items() if k != "name"))
    print("\n### Start-up\n")
    for r in by("startup/"):
        print(f"- `{r['name']}`: " + ", ".join(f"{k}={_fmt(v)}" for k, v in r.items() if k != "name"))
    if args.plots and by("batch/"):
        Path(args.plots).mkdir(parents=True, exist_ok=True)
        plot_batch(by("batch/"), Path(args.plots) / "batch_decode.png")


if __name__ == "__main__":
    main()
