"""The CUDA graphs' input staging (the graphs themselves run on the GPU only, tests/test_gpu_engine.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tokenmill.engine.worker.cuda_graphs import capture_each, stage_step_inputs
from tokenmill.layers.attention import AttentionMetadata


def test_a_steps_inputs_fill_the_static_buffers_and_padding_writes_nowhere() -> None:
    groups, capacity, max_blocks = 2, 8, 6
    static = SimpleNamespace(input_ids=torch.full((capacity,), 7), positions=torch.full((capacity,), 7),
                             slot_mapping=torch.full((groups, capacity), 5),
                             block_tables=torch.full((groups, capacity, max_blocks), 9, dtype=torch.int32))
    ids, positions = torch.tensor([11, 12, 13]), torch.tensor([40, 41, 42])
    slots = (torch.tensor([100, 101, 102]), torch.tensor([200, 201, 202]))
    tables = (torch.tensor([[1, 2, 3]] * 3, dtype=torch.int32), torch.tensor([[4, 5, 6]] * 3, dtype=torch.int32))
    meta = AttentionMetadata(slot_mapping=slots, query_start_loc=torch.arange(4, dtype=torch.int32),
                             seq_lens=torch.tensor([41, 42, 43], dtype=torch.int32), block_tables=tables,
                             max_query_len=1)
    stage_step_inputs(static, ids, positions, meta, padded=5)
    assert static.input_ids[:3].tolist() == [11, 12, 13] and static.positions[:3].tolist() == [40, 41, 42]
    for g in range(groups):
        assert static.slot_mapping[g].tolist() == slots[g].tolist() + [-1, -1, 5, 5, 5]
        assert torch.equal(static.block_tables[g, :3, :3], tables[g])
        assert (static.block_tables[g, 3:] == 9).all() and (static.block_tables[g, :, 3:] == 9).all()


def test_a_lone_chunk_after_a_long_prefix_replays_the_graph_that_splits_its_context(tmp_path, monkeypatch) -> None:
    """The lone-sequence prefill graphs: one per size over a whole context, and a second for the
    sizes whose attention would split the longest context's ranges; a chunk replays the second only
    with ``LONG_PREFIX`` tokens or more before it. (The graphs are stand-ins that record their replay.)"""
    from helpers import make_model_dir

    from tokenmill import LLM
    from tokenmill.engine.worker import prefill_graphs
    from tokenmill.engine.worker.prefill_graphs import LONG_PREFIX, PrefillGraphs

    make_model_dir("llama3", tmp_path)
    runner = LLM(str(tmp_path), device="cpu", dtype="float32").engine.core.runner
    asked = []

    def splits(k_cache, num_q_heads, num_tokens, max_query_len, max_seq_len, batch=1):
        asked.append((num_tokens, max_seq_len))
        return 4 if num_tokens < 64 else 1

    monkeypatch.setattr(prefill_graphs.ops, "paged_attention_kv_splits", splits)
    graphs = PrefillGraphs(runner.model, runner.kv_caches, 1, 128, 32, runner.model_config.vocab_size, torch.float32,
                           torch.device("cpu"))
    assert graphs.max_context == 32 * runner.block_size
    keys = graphs._keys()
    assert set(keys) == {(n, n) for n in graphs.sizes} | {(n, graphs.max_context) for n in graphs.sizes if n < 64}
    assert {(n, graphs.max_context) for n in graphs.sizes} <= set(asked)
    replayed = []
    graphs.graphs = {key: SimpleNamespace(replay=lambda key=key: replayed.append(key)) for key in keys}
    for tokens, before in ((20, 0), (20, LONG_PREFIX - 1), (20, LONG_PREFIX), (100, 400)):
        meta = AttentionMetadata(slot_mapping=(torch.full((tokens,), -1),), query_start_loc=torch.tensor([0, tokens]),
                                 seq_lens=torch.tensor([before + tokens]), block_tables=(torch.zeros(1, 32, dtype=torch.int32),),
                                 max_query_len=tokens, max_seq_len=before + tokens)
        graphs.run(torch.zeros(tokens, dtype=torch.int64), torch.arange(tokens), meta, torch.tensor([tokens - 1]))
    assert replayed == [(32, 32), (32, 32), (32, graphs.max_context), (128, 128)]
    assert graphs.long_prefix_replays == 1 and graphs.replays == 4
    assert graphs.logits_rows.tolist() == [99] and graphs.seq_lens.tolist() == [500]
    # A chunk that samples nothing: its graph's one logits row must not keep the last step's 99.
    meta = AttentionMetadata(slot_mapping=(torch.full((20,), -1),), query_start_loc=torch.tensor([0, 20]),
                             seq_lens=torch.tensor([20]), block_tables=(torch.zeros(1, 32, dtype=torch.int32),),
                             max_query_len=20, max_seq_len=20)
    graphs.run(torch.zeros(20, dtype=torch.int64), torch.arange(20), meta, torch.zeros(0, dtype=torch.int64))
    assert graphs.logits_rows.tolist() == [0] and graphs.seq_lens.tolist() == [20]


def _recorded_capture(failing: set[int]):
    """``capture_each``'s callables over integer keys, logging each call; a capture of a key in
    ``failing`` raises until that key has run eagerly (as a capture that needs a buffer made outside
    it does)."""
    log: list[tuple[str, int]] = []
    eager: set[int] = set()

    def forward(key: int) -> None:
        log.append(("eager", key))
        eager.add(key)

    def capture(key: int) -> str:
        log.append(("capture", key))
        if key in failing and key not in eager:
            raise RuntimeError(f"key {key} cannot be captured before it runs eagerly")
        return f"graph {key}"

    return log, forward, capture


def test_only_the_first_graph_runs_eagerly_and_a_failed_capture_runs_eagerly_then_again() -> None:
    log, forward, capture = _recorded_capture(failing={2})
    prepared: list[int] = []
    graphs, retried = capture_each([3, 2, 1], prepared.append, forward, capture)
    assert graphs == {3: "graph 3", 2: "graph 2", 1: "graph 1"} and prepared == [3, 2, 1] and retried == 1
    assert log == [("eager", 3), ("capture", 3), ("capture", 2), ("eager", 2), ("capture", 2), ("capture", 1)]


def test_every_graph_runs_eagerly_first_when_asked() -> None:
    """(As every rank of a tensor-parallel group does: a retry on one rank alone would launch
    collectives the others do not.)"""
    log, forward, capture = _recorded_capture(failing=set())
    assert capture_each([2, 1], lambda key: None, forward, capture, eager_each=True)[1] == 0
    assert log == [("eager", 2), ("capture", 2), ("eager", 1), ("capture", 1)]


def test_a_capture_that_fails_after_its_eager_run_raises() -> None:
    log, forward, capture = _recorded_capture(failing=set())

    def broken(key: int) -> str:
        raise RuntimeError("operation not permitted when stream is capturing")

    with pytest.raises(RuntimeError, match="not permitted"):
        capture_each([2, 1], lambda key: None, forward, lambda key: capture(key) if key == 2 else broken(key))


def test_capture_graphs_threads_one_pool_through_every_capture(monkeypatch) -> None:
    """``capture_graphs``' plumbing around ``capture_each``, with CUDA's stream and graph objects
    stood in for: every capture after the first gets the pool the one before it made or was given,
    a capture that fails is retried, and the pool comes back."""
    import contextlib

    from tokenmill.engine.worker import cuda_graphs

    pools_given: list[object] = []

    class Graph:
        made = 0

        def __init__(self) -> None:
            Graph.made += 1
            self.id = Graph.made

        def pool(self) -> str:
            return "pool"

    @contextlib.contextmanager
    def graph(g: Graph, pool: object = None, stream: object = None):
        pools_given.append(pool)
        yield
        if g.id == 2:  # the second key's first capture
            raise RuntimeError("operation not permitted when stream is capturing")

    stream = SimpleNamespace(wait_stream=lambda other: None)
    monkeypatch.setattr(torch.cuda, "Stream", lambda: stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    ran: list[int] = []
    graphs, pool = cuda_graphs.capture_graphs([3, 2, 1], lambda key: None, ran.append)
    assert sorted(graphs) == [1, 2, 3] and pool == "pool"
    assert ran == [3, 3, 2, 2, 2, 1]  # eager 3, capture 3, failed capture of 2, eager 2, capture 2, capture 1
    assert pools_given == [None, "pool", "pool", "pool"]
