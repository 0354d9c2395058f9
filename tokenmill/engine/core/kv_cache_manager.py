"""Block tables of the sequences, one per KV group, with prefix caching.

Each KV group (layers of one cache shape, see ``loader/kv_layout.py``) has its own
BlockPool and each sequence one block table per group; every group uses the same
block size, so token ``p`` sits at table index ``p // block_size`` in all of them
and one hash chain names a block in every group. A sliding-window group frees
the blocks its window has passed (before each step the sequence is scheduled in,
keeping every key the step's first query can still see) and puts its pool's
reserved null block in their place: the attention kernels never read below the
window, so the table keeps its positions without holding memory.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

from tokenmill.engine.core.block_pool import BlockHash, BlockPool, hash_blocks
from tokenmill.engine.sequence import Sequence


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int | Seq[int],
        block_size: int,
        enable_prefix_caching: bool = True,
        windows: Seq[int | None] = (None,),
    ) -> None:
        """``num_blocks`` (one count per group, or one int for a single group) and ``windows`` (each
        group's sliding window, None for full attention): a sliding group's first block is its null block."""
        counts = [num_blocks] if isinstance(num_blocks, int) else list(num_blocks)
        if len(counts) != len(windows):
            raise ValueError(f"{len(counts)} block counts for {len(windows)} KV groups")
        for n, window in zip(counts, windows):
            if n < 1 + (window is not None):
                raise ValueError(f"a KV group needs at least {1 + (window is not None)} blocks, got {n}")
        self.block_size = block_size
        self.windows = list(windows)
        self.windows_none = all(w is None for w in self.windows)  # no group frees blocks as it goes
        self.pools = [BlockPool(n, enable_prefix_caching) for n in counts]
        # The null block of each sliding group (taken once, never freed); None for full groups.
        self.null_blocks = [None if w is None else pool.allocate(1)[0] for pool, w in zip(self.pools, self.windows)]
        self.enable_caching = enable_prefix_caching
        self.query_tokens = 0  # prompt tokens looked up in the prefix cache
        self.hit_tokens = 0  # of which were found

    @property
    def num_groups(self) -> int:
        return len(self.pools)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _first_visible_block(self, group: int, position: int) -> int:
        """The first table index a query at ``position`` can see in ``group`` (0 for full attention)."""
        window = self.windows[group]
        return 0 if window is None else max(0, position - window + 1) // self.block_size

    # ----------------------------------------------------------------- prefix
    def match_prefix(self, seq: Sequence) -> int:
        """Give a new sequence the longest cached run of its full blocks that every group still holds
        (a sliding group only the blocks the first uncached token can see); always leaves at least its
        last token to compute, so the step that finishes it can sample."""
        assert not seq.block_tables and seq.num_computed_tokens == 0
        usable = self._cacheable_blocks(seq)
        if usable == 0:
            return 0
        hashes = full_block_hashes(seq, self.block_size)[:usable]
        found = [[pool.lookup(h) for h in hashes] for pool in self.pools]
        hit = self._longest_hit(found)
        if hit == 0:
            return 0
        seq.block_tables = [[] for _ in self.pools]
        for g, (pool, table) in enumerate(zip(self.pools, seq.block_tables)):
            first = self._first_visible_block(g, hit * self.block_size)
            if first:
                null = self.null_blocks[g]
                assert null is not None  # only a sliding group has blocks out of sight
                table.extend([null] * first)
            for block_id in found[g][first:hit]:
                assert block_id is not None  # ``_is_hit`` found every one
                pool.take_cached(block_id)
                table.append(block_id)
        seq.tables_changed()
        seq.num_computed_tokens = hit * self.block_size
        seq.num_committed_blocks = hit
        return seq.num_computed_tokens

    def _longest_hit(self, found: list[list[int | None]]) -> int:
        """The most leading blocks of ``found`` (each group's cached block per hash, None where it has
        none) that ``_is_hit`` accepts. A full-attention group needs every block before the hit, so
        none lies past its first miss: a new prompt (every block a miss) is answered at once, not by
        trying each length from the longest down, each a scan of the blocks before it."""
        usable = min(
            blocks.index(None) if window is None and None in blocks else len(blocks)
            for blocks, window in zip(found, self.windows)
        )
        return next((n for n in range(usable, 0, -1) if self._is_hit(found, n)), 0)

    def _is_hit(self, found: list[list[int | None]], num_blocks: int) -> bool:
        """Whether every group holds what computing on from ``num_blocks`` cached blocks needs."""
        return all(
            None not in found[g][self._first_visible_block(g, num_blocks * self.block_size) : num_blocks]
            for g in range(self.num_groups)
        )

    def _cacheable_blocks(self, seq: Sequence) -> int:
        """Full blocks a new sequence may take from the cache (never its last token; none when
        it wants prompt logprobs, which need every prompt position computed)."""
        if not self.enable_caching or seq.params.prompt_logprobs is not None:
            return 0
        return (seq.num_tokens - 1) // self.block_size

    def record_lookup(self, seq: Sequence) -> None:
        """Count an admitted sequence's prefix-cache lookup (once per admission, however
        many steps it waited for blocks)."""
        self.query_tokens += self._cacheable_blocks(seq) * self.block_size
        self.hit_tokens += seq.num_computed_tokens

    # ------------------------------------------------------------- allocation
    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Grow the block tables to hold ``num_new_tokens`` more (after freeing what sliding windows
        have passed); False, with nothing taken, if a pool is short."""
        if (
            seq.block_tables
            and self.windows_none
            and seq.num_computed_tokens + num_new_tokens <= len(seq.block_tables[0]) * self.block_size
        ):
            return True  # (most decode steps: the last block has room, and no window frees anything)
        if not seq.block_tables:
            seq.block_tables = [[] for _ in self.pools]
            seq.tables_changed()
        self._free_passed_blocks(seq)
        end = self.blocks_needed(seq.num_computed_tokens + num_new_tokens)
        needed = [end - len(table) for table in seq.block_tables]
        if any(n > pool.num_free for n, pool in zip(needed, self.pools)):
            return False
        for n, pool, table in zip(needed, self.pools, seq.block_tables):
            if n > 0:
                table.extend(pool.allocate(n))
        seq.tables_changed()
        return True

    def _free_passed_blocks(self, seq: Sequence) -> None:
        """Return the blocks no query from ``num_computed_tokens`` on can see (sliding groups). The null
        entries of a table are always a prefix, so only the blocks passed since the last step are walked."""
        for g, (pool, table) in enumerate(zip(self.pools, seq.block_tables)):
            null = self.null_blocks[g]
            if null is None:
                continue
            i = min(self._first_visible_block(g, seq.num_computed_tokens), len(table)) - 1
            while i >= 0 and table[i] != null:
                pool.free([table[i]])
                table[i] = null
                i -= 1
                seq.tables_changed()

    def commit_step(self, seqs: list[Sequence]) -> None:
        """``commit_computed_blocks`` for every sequence of a step that still runs (those that ended
        committed theirs when their blocks were freed; called only for those whose computed tokens
        reach past their committed blocks: most steps, none do)."""
        size = self.block_size
        for seq in seqs:
            if seq.num_computed_tokens >= (seq.num_committed_blocks + 1) * size and not seq.is_finished:
                self.commit_computed_blocks(seq)

    def commit_computed_blocks(self, seq: Sequence) -> None:
        """Make the sequence's newly full and computed blocks findable by later requests (in every
        group that still holds them)."""
        if seq.num_computed_tokens < (seq.num_committed_blocks + 1) * self.block_size:
            return  # (most steps: no block filled since the last commit)
        full = min(seq.num_computed_tokens, seq.num_tokens - seq.num_pending) // self.block_size
        if full <= seq.num_committed_blocks:
            return
        hashes = full_block_hashes(seq, self.block_size)
        for i in range(seq.num_committed_blocks, full):
            tokens = seq.token_ids[i * self.block_size : (i + 1) * self.block_size]
            for pool, table, null in zip(self.pools, seq.block_tables, self.null_blocks):
                if table[i] != null:
                    pool.commit(table[i], hashes[i], tokens)
        seq.num_committed_blocks = full

    def release_unused(self, seq: Sequence) -> None:
        """Return the blocks past what the sequence's known tokens need: those its rejected drafts
        took (their KV is never read, and is overwritten if the positions fill again)."""
        keep = self.blocks_needed(seq.num_tokens)
        for pool, table in zip(self.pools, seq.block_tables):
            if len(table) > keep:
                pool.free(table[keep:][::-1])
                del table[keep:]
                seq.tables_changed()

    def free(self, seq: Sequence) -> None:
        """Return the sequence's blocks, tail first into the eviction queue, after making its full
        computed blocks findable: a request that ends in the step that computes its prompt (one
        token asked for, or a stop on the first) leaves its prompt cached for the next one with
        the same prefix, and a preempted sequence finds its own blocks when admitted again. A
        block whose keys the step in flight still writes is safe to find: every later step that
        reads it is launched after that write on the same stream."""
        if seq.block_tables:
            self.commit_computed_blocks(seq)
        for pool, table, null in zip(self.pools, seq.block_tables, self.null_blocks):
            pool.free([b for b in reversed(table) if b != null])
        seq.block_tables = []
        seq.tables_changed()
        seq.num_committed_blocks = 0
        seq.num_computed_tokens = 0

    def longest_sequence(self, max_chunk: int) -> int | float:
        """The most tokens one sequence, prefilled in chunks of at most ``max_chunk``, can have in the
        empty pools (unbounded when only sliding groups hold it, each its window and a chunk at a time)."""
        longest: int | float = float("inf")
        for g, window in enumerate(self.windows):
            usable = self.usable_blocks(g)
            if window is None or usable < self.blocks_needed(window - 1 + max_chunk) + 1:
                longest = min(longest, usable * self.block_size)
        return longest

    # ------------------------------------------------------------------ stats
    def usable_blocks(self, group: int) -> int:
        """The group's blocks that sequences can hold (its null block excluded)."""
        return self.pools[group].num_blocks - (self.null_blocks[group] is not None)

    @property
    def capacity_tokens(self) -> int:
        """Tokens the pools hold over all sequences: the full-attention groups' (the smallest), or where
        every layer slides, the sliding groups' (whose blocks are freed as windows pass)."""
        full = [g for g, w in enumerate(self.windows) if w is None] or range(self.num_groups)
        return min(self.usable_blocks(g) for g in full) * self.block_size

    @property
    def num_blocks_in_use(self) -> int:
        """Blocks held by sequences, over every group."""
        return sum(self.usable_blocks(g) - pool.num_free for g, pool in enumerate(self.pools))

    @property
    def num_cached(self) -> int:
        return sum(pool.num_cached for pool in self.pools)

    def usage(self) -> float:
        """The fullest group's share in use: the one that decides when requests must wait."""
        return max((self.usable_blocks(g) - pool.num_free) / self.usable_blocks(g) for g, pool in enumerate(self.pools))


def full_block_hashes(seq: Sequence, block_size: int) -> list[BlockHash]:
    """Hashes of every full block of ``seq``'s known tokens, extended as the sequence grows."""
    done, known = len(seq.block_hashes) * block_size, seq.num_tokens - seq.num_pending
    if known - done >= block_size:
        seq.block_hashes += hash_blocks(
            seq.block_hashes[-1] if seq.block_hashes else None, seq.token_ids[done:known], block_size
        )
    return seq.block_hashes
