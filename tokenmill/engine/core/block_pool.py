"""The pool of KV-cache blocks and the prefix-cache table over it.

A block is in exactly one of three states: referenced by one or more
sequences (ref_count > 0); free and cached (ref_count 0, still findable by its
hash, evictable); or free and empty. Free blocks wait in one queue in the
order they were freed, so the least recently used cached block is evicted
first when a new block is needed.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

BlockHash = bytes


def hash_blocks(parent: BlockHash | None, token_ids: Sequence[int], block_size: int) -> list[BlockHash]:
    """The identities of the whole blocks of ``token_ids`` that follow the block hashed ``parent``
    (None: they start the sequence): each block's tokens and, through its parent's hash, every token
    before it. The tokens are packed once for all of them (a long prompt has hundreds)."""
    data, step = array("q", token_ids).tobytes(), 8 * block_size
    hashes, last = [], parent or b""
    for start in range(0, len(token_ids) // block_size * step, step):
        last = hashlib.blake2b(last + data[start : start + step], digest_size=16).digest()
        hashes.append(last)
    return hashes


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: BlockHash | None = None
    token_ids: tuple[int, ...] | None = None  # the tokens the hash covers (kept for checking)


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.enable_caching = enable_caching
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[BlockHash, int] = {}

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (empty or evictable)."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks

    def allocate(self, count: int) -> list[int]:
        """Take ``count`` blocks, evicting the least recently freed cached ones."""
        if count > len(self._free):
            raise RuntimeError(f"asked for {count} blocks, {len(self._free)} free")
        taken = []
        for _ in range(count):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            if block.hash is not None:
                del self._cached[block.hash]
                block.hash = block.token_ids = None
            block.ref_count = 1
            taken.append(block_id)
        return taken

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference to each block; unreferenced blocks join the free queue in the
        given order (pass a sequence's table reversed so its tail is evicted first)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise RuntimeError(f"block {block_id} freed more often than taken")
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None

    def lookup(self, block_hash: BlockHash) -> int | None:
        return self._cached.get(block_hash) if self.enable_caching else None

    def take_cached(self, block_id: int) -> None:
        """Add a reference to a cached block found by ``lookup``."""
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
        block.ref_count += 1

    def commit(self, block_id: int, block_hash: BlockHash, token_ids: Sequence[int]) -> None:
        """Make a full, computed block findable. A block whose content is already cached
        under another id stays private (both hold the same K/V, one is enough)."""
        if not self.enable_caching or block_hash in self._cached:
            return
        block = self.blocks[block_id]
        block.hash = block_hash
        block.token_ids = tuple(token_ids)
        self._cached[block_hash] = block_id
