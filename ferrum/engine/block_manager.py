"""Hands out fixed-size KV cache blocks to sequences and takes them back.

With prefix caching on, a block whose tokens are all computed is registered in
a PrefixCache under the chained hash of its prefix. A sequence being admitted
shares the cached blocks that hold its leading full blocks (their reference
count goes up) and skips computing them. A block returns to the free list only
when no sequence holds it, and keeps its cached KV there: the free list is
least-recently-freed first, so a cached free block is overwritten (and leaves
the index) only when it is the oldest one left. Blocks holding nothing
reusable go to the front of the free list, to be taken first.

With a sliding window on every layer (`window`), a sequence's blocks that lie
wholly before the window of its next query are given back as it advances
(`release_before_window`): its block table keeps their places, marked FREED,
so positions still map to table entries, and attention never reads them. A
released block goes back like a finished sequence's: registered in the prefix
cache (it holds a complete prefix block), it stays a cache hit for a later
sequence with the same leading tokens until its memory is taken for another.
"""

from __future__ import annotations

from collections import OrderedDict

from ferrum.engine.prefix_cache import (
    ROOT_HASH,
    BlockHash,
    BlockHasher,
    BlockTokens,
    PrefixCache,
    hash_block,
    token_bytes,
)
from ferrum.engine.sequence import Sequence

FREED = -1  # a block-table entry whose block was given back (before a sliding window): never read


def peak_tokens(max_model_len: int, chunk: int, block_size: int, window: int | None) -> int:
    """The most token slots one sequence holds at once: max_model_len, or with a sliding window on every
    layer the window's keys plus a chunk of `chunk` new tokens, each end rounded out to a whole block."""
    if window is None:
        return max_model_len
    return min(max_model_len, window - 1 + chunk + 2 * block_size)


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_caching: bool = True,
        block_hasher: BlockHasher = hash_block,
        window: int | None = None,
    ) -> None:
        """`window`: the sliding window every layer's attention has (a query sees itself and the window - 1
        tokens before it), whose earlier blocks are given back; None: the whole context is kept."""
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        if window is not None and window < 1:
            raise ValueError(f"the sliding window must be at least 1 token, got {window}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.window = window
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # front: taken first
        self._ref_counts: list[int] = [0] * num_blocks  # sequences holding each block
        self._cache: PrefixCache | None = PrefixCache() if enable_prefix_caching else None
        self._hasher = block_hasher
        self.prefix_cache_queries = 0  # tokens of admitted sequences looked up in the prefix cache
        self.prefix_cache_hits = 0  # of those, tokens whose KV came from the cache

    @property
    def enable_prefix_caching(self) -> bool:
        return self._cache is not None

    @property
    def num_free(self) -> int:
        """Blocks no sequence holds (cached ones included: they are taken when needed)."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Blocks held by at least one sequence."""
        return self.num_blocks - len(self._free)

    @property
    def num_cached(self) -> int:
        """Blocks registered in the prefix cache, held or free."""
        return len(self._cache) if self._cache is not None else 0

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    @staticmethod
    def held(seq: Sequence) -> int:
        """Blocks `seq` holds (its table's entries not given back)."""
        return len(seq.block_table) - seq.num_released_blocks


    # -- growing a sequence ------------------------------------------------
    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Extra blocks `seq` needs so that its first `num_tokens` tokens have slots."""
        want = -(-num_tokens // self.block_size)
        return max(0, want - len(seq.block_table))

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(seq, num_tokens) <= len(self._free)

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        need = self.blocks_needed(seq, num_tokens)
        if need > len(self._free):
            raise RuntimeError(f"out of KV blocks: need {need}, {len(self._free)} free")
        seq.block_table.extend(self._allocate() for _ in range(need))

    # -- admitting a sequence with its cached prefix ------------------------
    def cached_prefix(self, seq: Sequence) -> list[int]:
        """The cached blocks holding `seq`'s leading full blocks, in order, for a sequence that
        holds no blocks yet. At least its last token is left out (it must run to give logits),
        so no block the sequence will write into is ever among them. None for a sequence that still
        scores its prompt (prompt logprobs need every prompt position computed, as in vLLM); the
        blocks it computes are offered to the cache as anyone's."""
        if self._cache is None or seq.block_table or seq.num_computed_tokens or seq.scores_prompt:
            return []
        shareable = (seq.num_tokens - 1) // self.block_size
        found: list[int] = []
        parent = ROOT_HASH
        for i in range(shareable):  # hashed block by block: a miss ends it (and the hashing)
            block_hash = self._block_hashes(seq, i + 1)[i]
            block = self._cache.find(block_hash, parent, self._block_tokens(seq, i))
            if block is None:
                break
            found.append(block)
            parent = block_hash
        return found

    def can_admit(self, seq: Sequence, cached: list[int], num_tokens: int) -> bool:
        """Whether `seq` can share `cached` (from cached_prefix) and have slots for `num_tokens`."""
        want = -(-num_tokens // self.block_size)
        new_blocks = max(0, want - len(seq.block_table) - len(cached))
        revived = sum(1 for b in cached if self._ref_counts[b] == 0)  # cached blocks now on the free list
        return new_blocks + revived <= len(self._free)

    def admit(self, seq: Sequence, cached: list[int], num_tokens: int) -> None:
        """Shares `cached` with `seq` (its computed tokens jump over them), then grows it to
        `num_tokens` slots."""
        if not self.can_admit(seq, cached, num_tokens):
            raise RuntimeError(f"out of KV blocks to admit {seq.request_id!r}")
        if self._cache is not None:
            self.prefix_cache_queries += seq.num_tokens
            self.prefix_cache_hits += len(cached) * self.block_size
        for block in cached:
            if self._ref_counts[block] == 0:
                del self._free[block]
            self._ref_counts[block] += 1
        seq.block_table.extend(cached)
        seq.num_computed_tokens += len(cached) * self.block_size
        seq.num_cached_blocks = len(cached)
        self.grow(seq, num_tokens)

    # -- a sliding window -----------------------------------------------------
    def release_before_window(self, seq: Sequence) -> int:
        """Gives back `seq`'s blocks that lie wholly before the window of its next query (at position
        num_computed_tokens), after offering its computed blocks to the prefix cache; how many."""
        if self.window is None:
            return 0
        first_key = seq.num_computed_tokens - self.window + 1
        upto = min(max(0, first_key) // self.block_size, len(seq.block_table))
        if upto <= seq.num_released_blocks:
            return 0
        self.cache_computed_blocks(seq)
        for i in range(seq.num_released_blocks, upto):
            self._give_back(seq.block_table[i])
            seq.block_table[i] = FREED
        released = upto - seq.num_released_blocks
        seq.num_released_blocks = upto
        return released

    # -- speculative decoding ---------------------------------------------------
    def truncate(self, seq: Sequence) -> int:
        """Gives back `seq`'s blocks past its tokens (a verified draft's refused tokens had slots there);
        how many."""
        keep = max(-(-seq.num_tokens // self.block_size), seq.num_released_blocks)
        extra = seq.block_table[keep:]
        for block in extra:
            self._give_back(block)
        del seq.block_table[keep:]
        return len(extra)

    # -- registering computed blocks and giving blocks back -------------------
    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Registers the blocks of `seq` whose tokens have all been computed since the last call."""
        if self._cache is None:
            return
        full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        if full <= seq.num_cached_blocks:
            return
        hashes = self._block_hashes(seq, full)
        for i in range(max(seq.num_cached_blocks, seq.num_released_blocks), full):
            parent = hashes[i - 1] if i else ROOT_HASH
            # a no-op when another block already holds this prefix: this one is then freed plainly
            self._cache.add(seq.block_table[i], hashes[i], parent, self._block_tokens(seq, i))
        seq.num_cached_blocks = full

    def free(self, seq: Sequence) -> None:
        """Gives back `seq`'s blocks (registering its computed ones first); a block returns to
        the free list when no other sequence holds it."""
        self.cache_computed_blocks(seq)
        # last blocks first: a shared prefix's first blocks are the most reused, so evicted last
        table = reversed(seq.block_table) if self._cache is not None else seq.block_table
        for block in table:
            if block != FREED:
                self._give_back(block)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_cached_blocks = 0
        seq.num_released_blocks = 0

    def _give_back(self, block: int) -> None:
        """One sequence lets go of `block`: it returns to the free list when no other holds it."""
        self._ref_counts[block] -= 1
        if self._ref_counts[block] == 0:
            self._free[block] = None
            if self._cache is not None and not self._cache.holds(block):
                self._free.move_to_end(block, last=False)  # nothing worth keeping: reuse it first

    # -- helpers --------------------------------------------------------------
    def _allocate(self) -> int:
        block, _ = self._free.popitem(last=False)
        if self._cache is not None:
            self._cache.drop(block)  # its old KV is about to be overwritten
        self._ref_counts[block] = 1
        return block

    def _block_tokens(self, seq: Sequence, index: int) -> BlockTokens:
        return token_bytes(seq.tokens(index * self.block_size, (index + 1) * self.block_size))

    def _block_hashes(self, seq: Sequence, num_blocks: int) -> list[BlockHash]:
        """`seq`'s chained block hashes (kept on the sequence), computed up to at least its first
        `num_blocks` full blocks."""
        hashes = seq.block_hashes
        for i in range(len(hashes), num_blocks):
            parent = hashes[i - 1] if i else ROOT_HASH
            hashes.append(self._hasher(parent, self._block_tokens(seq, i)))
        return hashes
