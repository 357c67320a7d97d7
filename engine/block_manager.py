"""KV control plane: which physical block holds which tokens of which request.

Blocks are reference counted. A full, computed block gets a prefix hash chained from its parent
block's, so a later request with the same prefix reuses it; at ref count 0 it keeps its hash
and stays cached but free (evictable) in an LRU free queue (OrderedDict, O(1) everywhere).
Per-block state readers look at lives in numpy arrays updated in place, so a snapshot under
the engine lock is one array copy, never a walk over ~65k Python objects.
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np

from .sequence import Sequence


class Block:
    """The hash-chain record of one block (its ref count is `BlockManager.ref_count[id]`)."""
    __slots__ = ("block_id", "prefix_hash", "parent_hash", "token_ids", "salt_tag")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.prefix_hash: int | None = None
        self.parent_hash: int | None = None     # the previous block's hash in the chain
        self.token_ids: tuple[int, ...] = ()    # the tokens a hashed block holds
        self.salt_tag: int | None = None        # the salt digest of the request that hashed it


def chain_hash(parent: int | None, token_ids: tuple[int, ...]) -> int:
    return hash((parent if parent is not None else -1, token_ids))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # what readers see, kept in place: requests holding each block, and whether it holds a
        # registered prefix (hashed); evictable = hashed and ref 0
        self.ref_count = np.zeros(num_blocks, np.int32)
        self.hashed = np.zeros(num_blocks, np.bool_)
        # free blocks, least recently used first: allocation takes from the front
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.hash_to_block: dict[int, int] = {}
        self.hashes: dict[str, list[int]] = {}   # request id -> hashes of its leading full blocks
        self.prefix_hits = 0
        self.prefix_queries = 0
        self.evictions = 0

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def blocks_for(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def _match_prefix(self, seq: Sequence) -> list[int]:
        """Block ids that hold the longest cached prefix of seq. The last token is never
        served from the cache, so a fully cached prompt still computes its logits."""
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return []       # prompt logprobs need every prompt position's logits computed
        # the chain's root is the request's cache salt (interventions), None for a plain one
        bs, hits, parent = self.block_size, [], seq.cache_salt
        for i in range((len(seq) - 1) // bs):
            ids = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            h = chain_hash(parent, ids)
            bid = self.hash_to_block.get(h)
            # compare the whole key (parent, tokens): a hash collision must never reuse the
            # wrong K/V, not even a block with the same tokens at another position
            if bid is None or self.blocks[bid].token_ids != ids or \
                    self.blocks[bid].parent_hash != parent:
                break
            hits.append(bid)
            parent = h
        return hits

    def can_allocate(self, seq: Sequence) -> bool:
        hits = self._match_prefix(seq)
        fresh = self.blocks_for(len(seq)) - len(hits)
        revived = sum(1 for b in hits if self.ref_count[b] == 0)
        return fresh + revived <= self.num_free_blocks

    # ---- allocation ----------------------------------------------------------------------
    def _take_free(self) -> Block:
        bid, _ = self.free_queue.popitem(last=False)
        block = self.blocks[bid]
        if block.prefix_hash is not None:          # evict: its cached prefix is gone
            if self.hash_to_block.get(block.prefix_hash) == bid:
                del self.hash_to_block[block.prefix_hash]
            block.prefix_hash, block.parent_hash, block.token_ids, block.salt_tag = (
                None, None, (), None)
            self.hashed[bid] = False
            self.evictions += 1
        self.ref_count[bid] = 1
        return block

    def allocate(self, seq: Sequence) -> None:
        """Give seq a block table for all its current tokens, reusing cached prefix blocks."""
        assert not seq.block_table, "sequence already holds blocks"
        hits = self._match_prefix(seq)
        if self.enable_prefix_caching:
            self.prefix_queries += (len(seq) - 1) // self.block_size
            self.prefix_hits += len(hits)
        for bid in hits:
            if self.ref_count[bid] == 0:
                del self.free_queue[bid]
            self.ref_count[bid] += 1
        seq.block_table = hits + [self._take_free().block_id
                                  for _ in range(self.blocks_for(len(seq)) - len(hits))]
        self.hashes[seq.request_id] = [self.blocks[bid].prefix_hash for bid in hits]
        seq.num_cached_tokens = len(hits) * self.block_size
        seq.num_computed_tokens = seq.num_cached_tokens
        seq.prefix_cached_blocks += len(hits)

    def can_append(self, seq: Sequence, num_tokens: int) -> bool:
        """Enough free blocks for seq to hold num_tokens tokens in total?"""
        return self.blocks_for(num_tokens) - len(seq.block_table) <= self.num_free_blocks

    def append_slots(self, seq: Sequence, num_tokens: int) -> None:
        """Grow seq's block table to hold num_tokens tokens."""
        for _ in range(self.blocks_for(num_tokens) - len(seq.block_table)):
            seq.block_table.append(self._take_free().block_id)

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Keep the blocks that hold seq's first num_tokens tokens and drop its references to
        the rest (speculative decoding: blocks taken for drafts the target rejected; `free`:
        all of them). A block no one holds any more stays cached if hashed (evictable), else
        goes to the front of the queue, reused before any cached prefix is evicted. Draft
        blocks never hold a hash (commit sees accepted tokens only)."""
        keep = self.blocks_for(num_tokens)
        ref = self.ref_count
        for bid in reversed(seq.block_table[keep:]):
            ref[bid] -= 1
            assert ref[bid] >= 0, f"block {bid} freed twice"
            if ref[bid] == 0:
                self.free_queue[bid] = None
                if self.blocks[bid].prefix_hash is None:
                    self.free_queue.move_to_end(bid, last=False)
        seq.block_table = seq.block_table[:keep]      # a new list: a snapshot may hold the old

    def free(self, seq: Sequence) -> None:
        """Drop all of seq's references (see truncate) and its hash chain."""
        self.truncate(seq, 0)
        self.hashes.pop(seq.request_id, None)

    def commit(self, seq: Sequence) -> None:
        """Register prefix hashes for seq's blocks that are now full and computed."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        full = seq.num_computed_tokens // bs
        hashes = self.hashes.get(seq.request_id)
        if hashes is None:
            hashes = self.hashes[seq.request_id] = []
        elif len(hashes) >= full:       # most steps: no block completed (one in block_size)
            return
        for i in range(len(hashes), full):
            ids = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            parent = hashes[-1] if hashes else seq.cache_salt
            h = chain_hash(parent, ids)
            hashes.append(h)
            block = self.blocks[seq.block_table[i]]
            if block.prefix_hash is None and h not in self.hash_to_block:
                block.prefix_hash, block.parent_hash, block.token_ids = h, parent, ids
                block.salt_tag = seq.salt_tag
                self.hash_to_block[h] = block.block_id
                self.hashed[block.block_id] = True

    # ---- readers (under the engine lock) -----------------------------------------------------
    def block_token_ids(self, block_id: int, seqs) -> list[int]:
        """The token ids one block holds now: from a request whose table holds it (the tokens
        computed so far), else the tokens of its cached prefix. O(block_size + len(seqs))."""
        bs = self.block_size
        best: list[int] = []
        if self.ref_count[block_id] > 0:
            for seq in seqs:
                table = seq.block_table
                if block_id not in table:
                    continue
                j = table.index(block_id)
                known = min(seq.num_computed_tokens, seq.num_resolved_tokens)
                ids = seq.token_ids[j * bs:min((j + 1) * bs, known)]
                if len(ids) > len(best):
                    best = ids
        if not best and self.blocks[block_id].prefix_hash is not None:
            best = self.blocks[block_id].token_ids
        return list(best)

    # ---- invariants (tests and debugging) ------------------------------------------------
    def check_invariants(self, seqs: list[Sequence]) -> None:
        counts = [0] * self.num_blocks
        for s in seqs:
            for bid in s.block_table:
                counts[bid] += 1
        for b in self.blocks:
            i = b.block_id
            ref = int(self.ref_count[i])
            assert ref == counts[i], f"block {i}: ref {ref} != users {counts[i]}"
            assert (ref == 0) == (i in self.free_queue), f"block {i} free-list mismatch"
            assert bool(self.hashed[i]) == (b.prefix_hash is not None), f"block {i}: hashed flag"
        for h, bid in self.hash_to_block.items():
            assert self.blocks[bid].prefix_hash == h, "hash map points at a block with another hash"
        used = int((self.ref_count > 0).sum())
        assert used + self.num_free_blocks == self.num_blocks
