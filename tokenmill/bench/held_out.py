"""The embedded model's held-out texts: the validation files of its corpus (``corpus_files.txt``,
split ``val``), read from this Python's standard library. (On another Python version they differ
a little from the ones the model was trained on; comparisons on the same texts still hold.)"""

from __future__ import annotations

import sysconfig
from collections.abc import Iterator
from pathlib import Path

from tokenmill.default_model import DEFAULT_MODEL_DIR


def held_out_texts() -> Iterator[tuple[str, str]]:
    """``(file name, text)`` of each validation file, newlines normalised, in the corpus's order."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for line in (DEFAULT_MODEL_DIR / "corpus_files.txt").open():
        if line.startswith("val\t"):
            name = line.split("\t", 1)[1].rstrip("\n")
            yield name, (stdlib / name).read_text(encoding="utf-8").replace("\r\n", "\n").replace("\r", "\n")
