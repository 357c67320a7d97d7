"""BlockManager as a specification: random operation sequences against a simulated KV memory
(every slot remembers the prefix whose K/V it holds), plus hand-built prefix-cache scenarios."""
from __future__ import annotations

import itertools
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.block_manager import BlockManager
from engine.sampling import SamplingParams
from engine.sequence import Sequence

_ids = itertools.count()


def new_seq(tokens: list[int]) -> Sequence:
    return Sequence(f"s{next(_ids)}", list(tokens), SamplingParams(), 0)


class KVMemory:
    """What the paged cache would hold: slot -> the token prefix whose K/V were written there
    (K/V at position p depend on tokens[:p + 1], so a reused slot must hold the same prefix)."""

    def __init__(self, bm: BlockManager):
        self.bm = bm
        self.slots: dict[tuple[int, int], tuple[int, ...]] = {}

    def compute(self, seq: Sequence, n: int) -> None:
        """Write K/V of the next n tokens (the model runner's store), then commit (postprocess)."""
        bs = self.bm.block_size
        for p in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
            self.slots[(seq.block_table[p // bs], p % bs)] = tuple(seq.token_ids[:p + 1])
        seq.num_computed_tokens += n
        self.bm.commit(seq)

    def check(self, live: list[Sequence]) -> None:
        bm, bs = self.bm, self.bm.block_size
        bm.check_invariants(live)
        for seq in live:
            assert len(set(seq.block_table)) == len(seq.block_table), \
                f"{seq.request_id} holds one block twice: {seq.block_table}"
            assert len(seq.block_table) >= bm.blocks_for(len(seq)), "table too short"
            for p in range(seq.num_computed_tokens):
                got = self.slots.get((seq.block_table[p // bs], p % bs))
                assert got == tuple(seq.token_ids[:p + 1]), \
                    f"{seq.request_id} position {p} reads K/V of prefix {got}, not its own"
        for b in bm.blocks:
            if b.prefix_hash is not None:     # a cached block must hold exactly its tokens
                held = tuple(self.slots[(b.block_id, i)][-1] for i in range(bs))
                assert held == b.token_ids, f"block {b.block_id} claims {b.token_ids}, holds {held}"


OPS = ["new", "new", "compute", "compute", "compute", "append", "free", "preempt"]
# one operation: (kind, a, b); a and b pick a sequence, a length and new tokens (b's bits)
PROGRAM = st.lists(st.tuples(st.sampled_from(OPS), st.integers(0, 63), st.integers(0, 63)),
                   min_size=10, max_size=30)
DOCS = st.lists(st.lists(st.integers(0, 1), min_size=4, max_size=16), min_size=1, max_size=3)


def _run_program(program, docs, bs: int, num_blocks: int, caching: bool) -> None:
    bm = BlockManager(num_blocks, bs, caching)
    mem = KVMemory(bm)
    live: list[Sequence] = []
    preempted: list[Sequence] = []
    seen = list(docs)                      # new prompts are a prefix of one of these + a tail
    for op, a, b in program:
        if op == "new":
            if preempted and a % 2:
                seq = preempted.pop(0)
            else:
                base = seen[a % len(seen)]
                cut = len(base) if a % 3 else b % (len(base) + 1)
                seq = new_seq(base[:cut] + [(b >> i) & 1 for i in range(1 + a % 4)])
                seen.append(seq.token_ids)
            if len(seq) <= num_blocks * bs and bm.can_allocate(seq):
                bm.allocate(seq)
                assert seq.num_computed_tokens < len(seq), "the last token must be computed"
                assert seq.num_computed_tokens % bs == 0
                live.append(seq)
        elif live:
            seq = live[a % len(live)]
            if op == "compute" and seq.num_computed_tokens < len(seq):
                left = len(seq) - seq.num_computed_tokens
                mem.compute(seq, left if b % 2 else 1 + b % left)
            elif op == "append" and seq.num_computed_tokens == len(seq) \
                    and bm.can_append(seq, len(seq) + 1):
                seq.token_ids.append(b % 2)
                bm.append_slots(seq, len(seq))
            elif op == "free":
                bm.free(seq)
                live.remove(seq)
            elif op == "preempt":           # as the scheduler does: free and recompute later
                bm.free(seq)
                seq.num_computed_tokens = 0
                live.remove(seq)
                preempted.append(seq)
        mem.check(live)
    for seq in live:
        bm.free(seq)
    bm.check_invariants([])
    assert bm.num_free_blocks == num_blocks, "blocks leaked"


@settings(max_examples=100, deadline=None, database=None)
@given(program=PROGRAM, docs=DOCS, bs=st.integers(1, 4), num_blocks=st.integers(2, 16),
       caching=st.booleans())
def test_random_operations_keep_ref_counts_free_list_and_kv_contents_consistent(
        program, docs, bs, num_blocks, caching):
    _run_program(program, docs, bs, num_blocks, caching)


@settings(max_examples=100, deadline=None, database=None)
@given(program=PROGRAM, docs=DOCS, bs=st.integers(1, 4), num_blocks=st.integers(2, 16))
def test_random_operations_stay_correct_when_every_prefix_hash_collides(program, docs, bs,
                                                                       num_blocks):
    with mock.patch("engine.block_manager.chain_hash", lambda parent, ids: 0):
        _run_program(program, docs, bs, num_blocks, True)


def _computed(bm: BlockManager, mem: KVMemory, tokens: list[int]) -> Sequence:
    seq = new_seq(tokens)
    bm.allocate(seq)
    mem.compute(seq, len(seq) - seq.num_computed_tokens)
    return seq


def test_second_sequence_reuses_exactly_the_committed_full_blocks():
    bm = BlockManager(32, 4)
    mem = KVMemory(bm)
    a = _computed(bm, mem, [5, 1, 7, 3, 9, 2, 8, 4, 6, 6])        # 2 full blocks + 2 tokens
    b = new_seq(a.token_ids[:8] + [1, 1, 1])
    bm.allocate(b)
    assert b.block_table[:2] == a.block_table[:2]
    assert not set(b.block_table[2:]) & set(a.block_table)
    assert b.num_computed_tokens == 8
    c = new_seq(a.token_ids[:6] + [0, 0, 0, 0, 0])                # diverges in block 1
    bm.allocate(c)
    assert c.block_table[0] == a.block_table[0]
    assert not set(c.block_table[1:]) & set(a.block_table)
    assert c.num_computed_tokens == 4
    mem.check([a, b, c])


def test_blocks_not_yet_computed_are_not_reused():
    bm = BlockManager(32, 4)
    mem = KVMemory(bm)
    a = new_seq([5, 1, 7, 3, 9, 2, 8, 4, 6])
    bm.allocate(a)
    mem.compute(a, 6)                        # block 1 is only half computed
    b = new_seq(a.token_ids)
    bm.allocate(b)
    assert b.block_table[0] == a.block_table[0] and b.block_table[1] != a.block_table[1]
    assert b.num_computed_tokens == 4
    mem.check([a, b])


def test_hash_collision_never_reuses_a_block_holding_other_tokens(monkeypatch):
    monkeypatch.setattr("engine.block_manager.chain_hash", lambda parent, ids: 0)
    bm = BlockManager(32, 4)
    mem = KVMemory(bm)
    a = _computed(bm, mem, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    b = new_seq([9, 9, 9, 9, 5, 6, 7, 8, 1])                     # every hash collides with a's
    bm.allocate(b)
    assert b.num_computed_tokens == 0 and not set(b.block_table) & set(a.block_table)
    mem.check([a, b])


def test_hash_collision_never_reuses_a_block_at_another_position(monkeypatch):
    monkeypatch.setattr("engine.block_manager.chain_hash", lambda parent, ids: 0)
    bm = BlockManager(32, 4)
    mem = KVMemory(bm)
    a = _computed(bm, mem, [1, 2, 3, 4, 9])
    # block 1 has block 0's tokens but another prefix: its K/V are not a's block 0
    c = new_seq([1, 2, 3, 4, 1, 2, 3, 4, 7])
    bm.allocate(c)
    assert c.block_table[0] == a.block_table[0]
    assert c.num_computed_tokens == 4, f"reused {c.block_table} for {c.token_ids}"
    mem.check([a, c])


@pytest.mark.parametrize("length", [8, 9, 12])
def test_fully_cached_prompt_still_computes_its_last_token(length):
    bs = 4
    bm = BlockManager(16, bs)
    mem = KVMemory(bm)
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8][:length]
    a = _computed(bm, mem, tokens)
    bm.free(a)
    b = new_seq(tokens)
    bm.allocate(b)
    assert b.num_computed_tokens == (length - 1) // bs * bs
    assert b.num_computed_tokens < length
    mem.check([b])


def test_eviction_is_least_recently_used():
    bm = BlockManager(4, 2)
    mem = KVMemory(bm)
    prompts = {"a": [1, 1, 0], "b": [2, 2, 0], "c": [3, 3, 0]}
    for toks in prompts.values():            # each leaves one cached full block behind
        bm.free(_computed(bm, mem, toks))
    # the cache now holds a (oldest), b, c; touch a so that b becomes the oldest
    s = new_seq(prompts["a"])
    bm.allocate(s)
    assert s.num_computed_tokens == 2
    bm.free(s)

    def hit(key):
        probe = new_seq(prompts[key])
        return len(bm._match_prefix(probe))

    held = new_seq([7, 7, 7, 7])             # needs 2 blocks: 1 never-cached + 1 eviction
    bm.allocate(held)
    assert (hit("a"), hit("b"), hit("c")) == (1, 0, 1)
    assert bm.evictions == 1
    mem.check([held])


def test_blocks_without_a_prefix_are_reused_before_evicting_cached_ones():
    bm = BlockManager(4, 2)
    mem = KVMemory(bm)
    cached = _computed(bm, mem, [1, 1, 0])   # block 0 full+cached, block 1 partial
    bm.free(cached)
    s = new_seq([5, 5, 5, 5, 5])             # 3 blocks: the 3 uncached ones must be used
    bm.allocate(s)
    assert bm.evictions == 0
    assert len(bm._match_prefix(new_seq([1, 1, 0]))) == 1
    mem.check([s])
