"""Which KV blocks hold which token prefixes.

A full block of a sequence is named by a hash chained over the token ids of the
block and of every block before it: block i's hash covers block i-1's hash and
block i's own tokens, so two equal hashes name two equal whole prefixes. The
index maps such a hash to the one block whose KV holds that prefix; each entry
also keeps its parent hash and its token ids, and a lookup only hits when both
match, so a hash collision is refused instead of serving another prefix's KV.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable
from dataclasses import dataclass

BlockHash = bytes
BlockHasher = Callable[[BlockHash, tuple[int, ...]], BlockHash]

ROOT_HASH: BlockHash = b""  # the parent hash of a sequence's first block


def hash_block(parent: BlockHash, token_ids: tuple[int, ...]) -> BlockHash:
    """The chained hash of a block: BLAKE2b over the parent's hash and the block's token ids."""
    digest = hashlib.blake2b(parent, digest_size=32)
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


@dataclass(frozen=True)
class CachedBlock:
    block_id: int
    parent: BlockHash
    token_ids: tuple[int, ...]


class PrefixCache:
    """Hash -> block index of the blocks whose KV is complete and may be shared."""

    def __init__(self) -> None:
        self._by_hash: dict[BlockHash, CachedBlock] = {}
        self._hash_of_block: dict[int, BlockHash] = {}

    def __len__(self) -> int:
        return len(self._by_hash)

    def holds(self, block_id: int) -> bool:
        return block_id in self._hash_of_block

    def find(self, block_hash: BlockHash, parent: BlockHash, token_ids: tuple[int, ...]) -> int | None:
        """The block holding this prefix, or None (also when the hash collides with another prefix)."""
        entry = self._by_hash.get(block_hash)
        if entry is None or entry.parent != parent or entry.token_ids != token_ids:
            return None
        return entry.block_id

    def add(self, block_id: int, block_hash: BlockHash, parent: BlockHash, token_ids: tuple[int, ...]) -> bool:
        """Registers a block; False (and nothing changes) when the hash already names another
        block, or when this block is already registered."""
        if block_hash in self._by_hash or block_id in self._hash_of_block:
            return False
        self._by_hash[block_hash] = CachedBlock(block_id, parent, token_ids)
        self._hash_of_block[block_id] = block_hash
        return True

    def drop(self, block_id: int) -> None:
        """Forgets a block about to be overwritten; a no-op for a block not registered."""
        block_hash = self._hash_of_block.pop(block_id, None)
        if block_hash is not None:
            del self._by_hash[block_hash]

