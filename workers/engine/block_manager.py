"""The paged KV block pool: allocation, reference counts and prefix caching.

Blocks hold ``block_size`` tokens of K/V for every layer. A block is *referenced* by the block
tables of the sequences using it (``ref_count``) or *free* (``ref_count == 0``). Free blocks sit
in one LRU queue; a free block may still be *cached*: registered under the chained hash of the
full block of tokens it holds, so a later sequence with the same prefix reuses it instead of
recomputing it. Allocation takes the least recently freed block and evicts its hash.

Hash of block j = H(hash of block j-1, token ids of block j): equal hashes mean equal prefixes.
Block 0's parent is the sequence's ``hash_root`` (b"" for the base model, one per LoRA adapter):
the same tokens under another adapter have other K/V, so they never share blocks.
A full block is registered as soon as the step that computes it is scheduled; a sequence
scheduled later in the same step may already use it, because every layer writes the step's
K/V before it attends.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

from batchinfer.workers.engine.sequence import Sequence

if TYPE_CHECKING:
    from batchinfer.workers.engine_config import CacheConfig


def hash_block(parent: bytes, token_ids: Seq[int]) -> bytes:
    """Chained hash of one full block (128-bit BLAKE2b: collisions are not a practical concern)."""
    return hashlib.blake2b(parent + array("q", token_ids).tobytes(), digest_size=16).digest()


class BlockManager:
    """Owns block ids ``0 .. num_blocks-1``; the model runner owns the tensors they index."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # hash -> block id
        # Blocks with ref_count 0, least recently freed first (the eviction order).
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        # Prefix-cache statistics (tokens queried / tokens hit), for metrics.
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0

    @classmethod
    def from_config(cls, num_blocks: int, cache: CacheConfig) -> BlockManager:
        """A pool of ``num_blocks`` blocks (the model runner's count) shaped by the engine's cache part."""
        return cls(num_blocks, cache.block_size, cache.enable_prefix_caching)

    # -- state ----------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks allocatable now (free, whether or not they still hold a cached prefix)."""
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by live sequences."""
        return 1.0 - len(self.free_queue) / self.num_blocks

    @property
    def prefix_hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix caching -------------------------------------------------------------------------

    def _full_block_hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """The sequence's chained hashes of its first ``num_blocks`` full blocks (memoised)."""
        hashes, bs, tokens = seq.block_hashes, self.block_size, seq.token_ids
        while len(hashes) < num_blocks:
            j = len(hashes)
            hashes.append(hash_block(hashes[-1] if hashes else seq.hash_root, tokens[j * bs:(j + 1) * bs]))
        return hashes

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding the longest prefix of ``seq``'s tokens (nothing is referenced yet).

        At least the last token is always left to compute: its logits are needed to sample.
        """
        if not self.enable_prefix_caching:
            return []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for h in self._full_block_hashes(seq, max_blocks)[:max_blocks]:
            block = self.cached.get(h)
            if block is None:
                break
            hits.append(block)
        return hits

    # -- allocation -----------------------------------------------------------------------------

    def can_allocate(self, seq: Sequence, num_new_tokens: int, cached_blocks: Seq[int] = ()) -> bool:
        total = seq.num_computed_tokens + len(cached_blocks) * self.block_size + num_new_tokens
        needed = self.blocks_needed(total) - len(seq.block_table) - len(cached_blocks)
        # Reusing a free cached block takes it out of the free queue too.
        revived = sum(1 for b in cached_blocks if self.ref_counts[b] == 0)
        return needed + revived <= len(self.free_queue)

    def allocate(self, seq: Sequence, num_new_tokens: int, cached_blocks: Seq[int] = (),
                 num_lookahead_tokens: int = 0) -> bool:
        """Grow ``seq``'s block table so that ``num_new_tokens`` more tokens fit; False if they can't.

        ``cached_blocks`` (from ``find_cached_prefix``, only for a sequence holding no blocks) are
        referenced first; the caller then counts their tokens as computed. Blocks that the step
        fills up completely are registered in the prefix cache. ``num_lookahead_tokens`` more slots
        are made room for after them (draft tokens of speculative decoding): never registered, as
        their tokens are not the sequence's until verified.
        """
        if not cached_blocks:  # the decode fast path: the tokens fit the blocks the sequence holds
            total = seq.num_computed_tokens + num_new_tokens
            if total + num_lookahead_tokens <= len(seq.block_table) * self.block_size:
                if self.enable_prefix_caching and total // self.block_size > seq.num_hashed_blocks:
                    self._register_full_blocks(seq, total // self.block_size)
                return True
        elif seq.block_table:
            raise ValueError("cached_blocks can only start an empty block table")
        if not self.can_allocate(seq, num_new_tokens + num_lookahead_tokens, cached_blocks):
            return False
        table = seq.block_table
        if self.enable_prefix_caching and not table:  # a (re)admission: count the prefix lookup
            self.num_queried_tokens += seq.num_tokens
            self.num_hit_tokens += len(cached_blocks) * self.block_size
        for b in cached_blocks:
            self._ref(b)
            table.append(b)
        total = seq.num_computed_tokens + len(cached_blocks) * self.block_size + num_new_tokens
        for _ in range(self.blocks_needed(total + num_lookahead_tokens) - len(table)):
            table.append(self._take_free_block())
        if cached_blocks:
            seq.num_hashed_blocks = len(cached_blocks)
        if self.enable_prefix_caching:
            self._register_full_blocks(seq, total // self.block_size)
        return True

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s references. Its cached blocks stay reusable until evicted.

        Tail blocks are freed first so that they are evicted before the shared prefix.
        """
        self._release(seq.block_table)
        seq.block_table = []
        seq.num_hashed_blocks = 0

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Free ``seq``'s blocks past the first ``num_tokens`` tokens (the slots of rejected draft
        tokens): they were never registered, so they go to the front of the free queue."""
        table, keep = seq.block_table, self.blocks_needed(num_tokens)
        if len(table) <= keep:
            return
        self._release(table[keep:])
        # A new list, not a shortened one: the runner's kept rows (BlockTableRows) tell a changed
        # table by identity, and this one may grow back past its old length before the next step.
        seq.block_table = table[:keep]
        seq.num_hashed_blocks = min(seq.num_hashed_blocks, keep)

    def _release(self, blocks: list[int]) -> None:
        """Drop one reference to each of ``blocks``, the last first; a block no longer referenced
        joins the free queue: at its end when it holds a cached prefix (evicted last), else at its
        front (nothing worth keeping: reused first)."""
        for b in reversed(blocks):
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self.free_queue[b] = None
                if self.block_hash[b] is None:
                    self.free_queue.move_to_end(b, last=False)

    def _ref(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            del self.free_queue[block]
        self.ref_counts[block] += 1

    def _take_free_block(self) -> int:
        block, _ = self.free_queue.popitem(last=False)
        h = self.block_hash[block]
        if h is not None:  # evict the least recently used cached prefix
            if self.cached.get(h) == block:
                del self.cached[h]
            self.block_hash[block] = None
        self.ref_counts[block] = 1
        return block

    def _register_full_blocks(self, seq: Sequence, num_full_blocks: int) -> None:
        if num_full_blocks <= seq.num_hashed_blocks:
            return
        hashes = self._full_block_hashes(seq, num_full_blocks)
        for j in range(seq.num_hashed_blocks, num_full_blocks):
            block, h = seq.block_table[j], hashes[j]
            # A duplicate (a sibling computed the same block in parallel) stays unregistered.
            if self.block_hash[block] is None and h not in self.cached:
                self.cached[h] = block
                self.block_hash[block] = h
        seq.num_hashed_blocks = num_full_blocks
