"""Block tables of the sequences, over one shared BlockPool, with prefix caching."""

from __future__ import annotations

from tokenmill.engine.block_pool import BlockPool
from tokenmill.engine.sequence import Sequence


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.query_tokens = 0  # prompt tokens looked up in the prefix cache
        self.hit_tokens = 0  # of which were found

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def match_prefix(self, seq: Sequence) -> int:
        """Give a new sequence the longest cached run of its full blocks; always leaves at
        least its last token to compute, so the step that finishes it can sample."""
        assert not seq.block_table and seq.num_computed_tokens == 0
        usable = self._cacheable_blocks(seq)
        if usable == 0:
            return 0
        for block_hash in seq.full_block_hashes(self.block_size)[:usable]:
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                break
            self.pool.take_cached(block_id)
            seq.block_table.append(block_id)
        cached = len(seq.block_table) * self.block_size
        seq.num_computed_tokens = cached
        seq.num_committed_blocks = len(seq.block_table)
        return cached

    def _cacheable_blocks(self, seq: Sequence) -> int:
        """Full blocks a new sequence may take from the cache (never its last token; none when
        it wants prompt logprobs, which need every prompt position computed)."""
        if not self.pool.enable_caching or seq.params.prompt_logprobs is not None:
            return 0
        return (seq.num_tokens - 1) // self.block_size

    def record_lookup(self, seq: Sequence) -> None:
        """Count an admitted sequence's prefix-cache lookup (once per admission, however
        many steps it waited for blocks)."""
        self.query_tokens += self._cacheable_blocks(seq) * self.block_size
        self.hit_tokens += seq.num_computed_tokens

    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Grow the block table to hold ``num_new_tokens`` more; False if the pool is short."""
        needed = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        if needed > self.pool.num_free:
            return False
        if needed > 0:
            seq.block_table.extend(self.pool.allocate(needed))
        return True

    def commit_computed_blocks(self, seq: Sequence) -> None:
        """Make the sequence's newly full and computed blocks findable by later requests."""
        full = min(seq.num_computed_tokens, seq.num_tokens - seq.num_pending) // self.block_size
        if full <= seq.num_committed_blocks:
            return
        hashes = seq.full_block_hashes(self.block_size)
        for i in range(seq.num_committed_blocks, full):
            tokens = seq.token_ids[i * self.block_size:(i + 1) * self.block_size]
            self.pool.commit(seq.block_table[i], hashes[i], tokens)
        seq.num_committed_blocks = full

    def free(self, seq: Sequence) -> None:
        """Return the sequence's blocks, tail first into the eviction queue."""
        self.pool.free(list(reversed(seq.block_table)))
        seq.block_table = []
        seq.num_committed_blocks = 0
        seq.num_computed_tokens = 0

    @property
    def num_blocks_in_use(self) -> int:
        return self.pool.num_blocks - self.pool.num_free
