"""Property tests of the block pool, the prefix cache and the scheduler over them.

A fake model runner writes each computed token's id into a fake KV cache at its
slot, so "a prefix-cache hit returns blocks holding exactly those tokens" is
checked against what was really written, after any sequence of adds,
steps, finishes, aborts, preemptions and speculative drafts (some accepted, the
rest walked back as the engine does).
"""

from __future__ import annotations

import time

from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from helpers import num_scheduled_tokens

from tokenmill.engine.core.block_pool import BlockPool, hash_blocks
from tokenmill.engine.core.kv_cache_manager import KVCacheManager
from tokenmill.engine.core.scheduler import Scheduler, SchedulerConfig
from tokenmill.engine.sequence import Sequence
from tokenmill.engine.worker.sequence_rows import SequenceRows
from tokenmill.sampling_params import SamplingParams

BLOCK = 4
NUM_BLOCKS = 12


def hash_block(parent: bytes | None, token_ids: list[int]) -> bytes:
    return hash_blocks(parent, token_ids, len(token_ids))[0]


# Prompts built from a few shared stems over a tiny alphabet, so prefixes repeat often.
STEMS = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [5, 5, 5, 5]]


class EngineMachine(RuleBasedStateMachine):
    """One full-attention KV group; the subclass below adds a sliding-window group."""

    WINDOWS: tuple[int | None, ...] = (None,)

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager([NUM_BLOCKS] * len(self.WINDOWS), BLOCK, enable_prefix_caching=True,
                                 windows=self.WINDOWS)
        self.scheduler = Scheduler(SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=10), self.kv)
        self.rows = SequenceRows(len(self.WINDOWS), vocab_size=100, capacity=2)
        self.caches: list[dict[int, int]] = [{} for _ in self.WINDOWS]  # per group: slot -> token id written there
        self.live: list[Sequence] = []
        self.next_id = 0

    @rule(stem=st.sampled_from(STEMS), tail=st.lists(st.integers(0, 3), max_size=9), n=st.integers(1, 2))
    def add(self, stem: list[int], tail: list[int], n: int) -> None:
        prompt = stem + tail
        request_id = str(self.next_id)  # (n sequences of one request, as for SamplingParams.n)
        for index in range(n):
            seq = Sequence(self.next_id, request_id, index, prompt, SamplingParams(max_tokens=8), time.time(), None)
            self.next_id += 1
            self.scheduler.add(seq)
            self.live.append(seq)

    @precondition(lambda self: any(s.num_computed_tokens == s.num_tokens - 1 for s in self.scheduler.running))
    @rule(drafts=st.lists(st.integers(0, 3), min_size=1, max_size=4))
    def propose(self, drafts: list[int]) -> None:
        seq = next(s for s in self.scheduler.running if s.num_computed_tokens == s.num_tokens - 1)
        seq.draft_token_ids = drafts[:max(0, 29 - seq.num_tokens)]

    @rule(new_token=st.integers(0, 3), accepted=st.integers(0, 4))
    def step(self, new_token: int, accepted: int) -> None:
        batch = self.scheduler.schedule()
        for seq, n in zip(batch.seqs, batch.num_tokens):
            scheduled = seq.scheduled_token_ids(seq.num_computed_tokens, n)
            for pos, token in enumerate(scheduled, start=seq.num_computed_tokens):
                for table, cache in zip(seq.block_tables, self.caches):
                    cache[table[pos // BLOCK] * BLOCK + pos % BLOCK] = token
            seq.num_computed_tokens += n
            self.kv.commit_computed_blocks(seq)
            if seq.num_computed_tokens == num_scheduled_tokens(seq):
                drafts = seq.draft_token_ids
                kept = min(accepted, len(drafts))
                seq.num_computed_tokens -= len(drafts) - kept
                seq.token_ids.extend(drafts[:kept] + [new_token])
                seq.draft_token_ids = []
                self.kv.release_unused(seq)
                self.kv.commit_computed_blocks(seq)
                if seq.num_tokens >= 30:
                    self._finish(seq)

    def _finish(self, seq: Sequence) -> None:
        self.scheduler.finish(seq)
        self.live.remove(seq)

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 100))
    def abort(self, index: int) -> None:
        self._finish(self.live[index % len(self.live)])

    @precondition(lambda self: self.scheduler.running)
    @rule()
    def preempt_newest(self) -> None:
        self.scheduler._preempt(self.scheduler.running.pop())

    @invariant()
    def request_gauges_match_the_queues(self) -> None:
        running = {seq.request_id for seq in self.scheduler.running}
        waiting = {seq.request_id for seq in self.scheduler.waiting} - running
        assert (self.scheduler.num_running_requests, self.scheduler.num_waiting_requests) == (len(running), len(waiting))

    @invariant()
    def ref_counts_match_block_tables(self) -> None:
        for g, (pool, null) in enumerate(zip(self.kv.pools, self.kv.null_blocks)):
            held: dict[int, int] = {} if null is None else {null: 1}
            for seq in self.live:
                for block_id in seq.block_tables[g] if seq.block_tables else []:
                    if block_id != null:
                        held[block_id] = held.get(block_id, 0) + 1
            for block in pool.blocks:
                assert block.ref_count >= 0
                assert block.ref_count == held.get(block.block_id, 0)
            assert pool.num_free == sum(1 for b in pool.blocks if b.ref_count == 0)
        assert all(not seq.block_tables for seq in self.scheduler.waiting), "waiting sequences hold no blocks"

    @invariant()
    def the_kept_table_rows_are_the_tables(self) -> None:
        """The int32 copy of the running sequences' tables the model runner reads (``SequenceRows``, two
        rows to start with, so rows are reclaimed and grown) is written again after every change the
        KV manager makes, zero past each table (copying here: a later missed change shows as stale)."""
        running = list(self.scheduler.running)
        tables = self.rows.block_tables(self.rows.rows_of(running))
        for b, seq in enumerate(running):
            for g in range(len(self.WINDOWS)):
                table = seq.block_tables[g] if seq.block_tables else []
                assert tables[g, b].tolist() == table + [0] * (tables.shape[2] - len(table))

    @invariant()
    def visible_computed_tokens_are_in_the_cache(self) -> None:
        """Every computed token a next query can still see (all of them, or its group's window)."""
        for seq in self.scheduler.running:
            for g, (table, cache, window) in enumerate(zip(seq.block_tables, self.caches, self.WINDOWS)):
                first = 0 if window is None else max(0, seq.num_computed_tokens - window + 1) // BLOCK * BLOCK
                for pos in range(first, seq.num_computed_tokens):
                    assert table[pos // BLOCK] != self.kv.null_blocks[g]
                    assert cache.get(table[pos // BLOCK] * BLOCK + pos % BLOCK) == seq.token_ids[pos]

    @invariant()
    def no_block_past_the_known_tokens_and_drafts(self) -> None:
        for seq in self.scheduler.running:
            for table in seq.block_tables:
                assert len(table) <= self.kv.blocks_needed(max(num_scheduled_tokens(seq), seq.num_computed_tokens))

    @invariant()
    def sliding_groups_hold_only_their_window(self) -> None:
        for seq in self.scheduler.running:
            for g, (table, window) in enumerate(zip(seq.block_tables, self.WINDOWS)):
                if window is not None:
                    held = sum(b != self.kv.null_blocks[g] for b in table)
                    assert held <= -(-(window - 1 + 10) // BLOCK) + 1  # the window and one chunk

    @invariant()
    def cached_blocks_hold_their_tokens(self) -> None:
        for pool, cache in zip(self.kv.pools, self.caches):
            for block_hash, block_id in pool._cached.items():
                block = pool.blocks[block_id]
                assert block.hash == block_hash
                written = [cache.get(block_id * BLOCK + i) for i in range(BLOCK)]
                assert tuple(written) == block.token_ids

    def teardown(self) -> None:
        for seq in list(self.live):
            self._finish(seq)
        assert self.kv.num_blocks_in_use == 0, "blocks leaked"


class SlidingEngineMachine(EngineMachine):
    WINDOWS = (None, 6)


TestEngineMachine = EngineMachine.TestCase
TestEngineMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestSlidingEngineMachine = SlidingEngineMachine.TestCase
TestSlidingEngineMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


@given(st.lists(st.integers(0, 2**40), max_size=30), st.integers(0, 30), st.sampled_from([1, 4, 16]))
def test_hashing_a_run_of_blocks_at_once_chains_as_one_at_a_time(tokens: list[int], cut: int, block: int) -> None:
    """A sequence's hashes are extended as it grows: any split of its tokens at a block boundary gives
    the chain one block at a time gives, and a partial last block gets none."""
    one_by_one, parent = [], None
    for start in range(0, len(tokens) - block + 1, block):
        parent = hash_block(parent, tokens[start:start + block])
        one_by_one.append(parent)
    cut = min(cut, len(tokens)) // block * block
    head = hash_blocks(None, tokens[:cut], block)
    assert head + hash_blocks(head[-1] if head else None, tokens[cut:], block) == one_by_one


def test_hash_chains_over_the_parent() -> None:
    a = hash_block(None, [1, 2, 3, 4])
    assert hash_block(a, [5, 6, 7, 8]) != hash_block(hash_block(None, [0, 2, 3, 4]), [5, 6, 7, 8])
    assert hash_block(a, [5, 6, 7, 8]) == hash_block(hash_block(None, [1, 2, 3, 4]), [5, 6, 7, 8])


def test_lru_eviction_takes_the_least_recently_freed_cached_block() -> None:
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    for block_id, tokens in ((a, [1]), (b, [2]), (c, [3])):
        pool.commit(block_id, hash_block(None, tokens), tokens)
    pool.free([b])
    pool.free([a])
    pool.free([c])
    assert pool.num_cached == 3
    (taken,) = pool.allocate(1)
    assert taken == b
    assert pool.lookup(hash_block(None, [2])) is None
    assert pool.lookup(hash_block(None, [1])) == a


def test_a_hit_revives_a_free_cached_block() -> None:
    pool = BlockPool(2)
    (a,) = pool.allocate(1)
    pool.commit(a, hash_block(None, [7]), [7])
    pool.free([a])
    assert pool.num_free == 2
    pool.take_cached(pool.lookup(hash_block(None, [7])))
    assert pool.num_free == 1 and pool.blocks[a].ref_count == 1


def test_a_blocked_admission_counts_its_prefix_lookup_once() -> None:
    kv = KVCacheManager(num_blocks=5, block_size=4)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), kv)

    def seq(i: int, prompt: list[int]) -> Sequence:
        return Sequence(i, str(i), 0, prompt, SamplingParams(), time.time(), None)

    first = seq(0, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    scheduler.add(first)
    scheduler.schedule()
    first.num_computed_tokens = first.num_tokens
    kv.commit_computed_blocks(first)
    scheduler.finish(first)  # its two full blocks stay cached
    hog = seq(1, list(range(20, 32)))  # takes the 3 blocks that are not cached
    scheduler.add(hog)
    scheduler.schedule()
    waiter = seq(2, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13])  # 2 cached blocks + 2 new: none free
    scheduler.add(waiter)
    for _ in range(3):
        scheduler.schedule()
    assert waiter in scheduler.waiting and not waiter.block_tables
    assert (kv.query_tokens, kv.hit_tokens) == (16, 0)  # the first and the hog (8 tokens each), no hits
    scheduler.finish(hog)
    scheduler.schedule()
    assert waiter in scheduler.running
    assert (kv.query_tokens, kv.hit_tokens) == (16 + 12, 8)


@given(windows=st.lists(st.sampled_from([None, 4, 8, 13]), min_size=1, max_size=3),
       data=st.data())
def test_the_longest_prefix_hit_is_the_longest_every_group_can_serve(windows: list[int | None], data) -> None:
    """A lookup takes the most leading cached blocks that every group holds, as trying each length
    from the longest down finds them (a full group needs every block before the hit, a sliding one
    those its window still sees), whatever blocks each group has lost."""
    kv = KVCacheManager([NUM_BLOCKS] * len(windows), BLOCK, windows=windows)
    usable = data.draw(st.integers(0, 12))
    found = [data.draw(st.lists(st.one_of(st.none(), st.integers(0, 99)), min_size=usable, max_size=usable))
             for _ in windows]
    tried = next((n for n in range(usable, 0, -1) if kv._is_hit(found, n)), 0)
    assert kv._longest_hit(found) == tried


def test_a_preempted_sequence_finds_its_computed_blocks_when_admitted_again() -> None:
    """Preemption frees a sequence's blocks with those its last step computed committed (no step
    completed since), so its recompute starts from the cache."""
    kv = KVCacheManager(num_blocks=8, block_size=4)
    victim = Sequence(0, "0", 0, list(range(1, 11)), SamplingParams(), time.time(), None)
    assert kv.match_prefix(victim) == 0 and kv.allocate(victim, 10)
    victim.num_computed_tokens = 10  # its prompt's step launched; nothing committed yet
    kv.free(victim)  # as Scheduler._preempt does
    assert kv.match_prefix(victim) == 8  # its two full blocks; the last token is always computed
