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
from collections.abc import Callable, Sequence

BlockHash = bytes
BlockTokens = bytes  # a block's token ids as little-endian int64s (see token_bytes)
BlockHasher = Callable[[BlockHash, BlockTokens], BlockHash]

ROOT_HASH: BlockHash = b""  # the parent hash of a sequence's first block


def token_bytes(token_ids: Sequence[int]) -> BlockTokens:
    """A block's token ids in the form the index hashes and keeps: bytes, which the garbage
    collector does not track (tens of thousands of cached blocks cost it nothing)."""
    return array("q", token_ids).tobytes()


def hash_block(parent: BlockHash, tokens: BlockTokens) -> BlockHash:
    """The chained hash of a block: BLAKE2b over the parent's hash and the block's token ids."""
    digest = hashlib.blake2b(parent, digest_size=32)
    digest.update(tokens)
    return digest.digest()


class PrefixCache:
    """Hash -> block index of the blocks whose KV is complete and may be shared. Held in three
    flat dicts of ints and bytes (no object per entry)."""

    def __init__(self) -> None:
        self._block_of_hash: dict[BlockHash, int] = {}
        self._hash_of_block: dict[int, BlockHash] = {}
        self._prefix_of_hash: dict[BlockHash, bytes] = {}  # parent hash + the block's tokens

    def __len__(self) -> int:
        return len(self._block_of_hash)

    def holds(self, block_id: int) -> bool:
        return block_id in self._hash_of_block

    def find(self, block_hash: BlockHash, parent: BlockHash, tokens: BlockTokens) -> int | None:
        """The block holding this prefix, or None (also when the hash collides with another prefix:
        blocks have one length, so equal parent+tokens bytes mean equal parents and tokens)."""
        block = self._block_of_hash.get(block_hash)
        if block is None or self._prefix_of_hash[block_hash] != parent + tokens:
            return None
        return block

    def add(self, block_id: int, block_hash: BlockHash, parent: BlockHash, tokens: BlockTokens) -> bool:
        """Registers a block; False (and nothing changes) when the hash already names another
        block, or when this block is already registered."""
        if block_hash in self._block_of_hash or block_id in self._hash_of_block:
            return False
        self._block_of_hash[block_hash] = block_id
        self._hash_of_block[block_id] = block_hash
        self._prefix_of_hash[block_hash] = parent + tokens
        return True

    def drop(self, block_id: int) -> None:
        """Forgets a block about to be overwritten; a no-op for a block not registered."""
        block_hash = self._hash_of_block.pop(block_id, None)
        if block_hash is not None:
            del self._block_of_hash[block_hash]
            del self._prefix_of_hash[block_hash]
