"""LLM.inspect() snapshots against the engine's own invariants: block tables vs ref counts and
owners, the token ids each block holds, prefix-cache state after requests finish, the KV
layout's byte counts, and the step traces."""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from engine import LLM, EngineSnapshot, SamplingParams

BLOCK = 4
NUM_BLOCKS = 128
MAX_TOKENS = 80


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 200, (n,), generator=g).tolist()


@pytest.fixture(scope="module")
def llm(model_factory):
    engine = LLM(model_factory("qwen3"), device="cpu", block_size=BLOCK,
                 num_kv_blocks=NUM_BLOCKS, max_num_batched_tokens=16)
    yield engine
    engine.shutdown()


def computed_tokens(snap: EngineSnapshot, rid: str) -> int:
    """Tokens with K/V in the cache after the snapshot's latest step that ran rid."""
    last = [e for st in snap.steps for e in st.entries if e.request_id == rid][-1]
    return last.start_pos + last.num_tokens


def assert_block_accounting(snap: EngineSnapshot) -> None:
    """Blocks in some block table are exactly those with ref > 0; ref = number of owners,
    and the owners are the requests whose tables hold the block."""
    held = {}
    for rid, table in snap.block_tables.items():
        assert len(set(table)) == len(table), f"{rid} holds a block twice"
        for bid in table:
            held.setdefault(bid, []).append(rid)
    assert set(held) == {b.block_id for b in snap.blocks if b.ref_count > 0}
    assert set(held) == set(np.flatnonzero(snap.block_ref).tolist())
    for b in snap.blocks:
        assert b.ref_count == len(b.owners), b
        assert sorted(b.owners) == sorted(held.get(b.block_id, [])), b
        assert 0 <= b.num_filled <= snap.block_size
        assert b.evictable == (b.ref_count == 0 and bool(snap.block_hashed[b.block_id]))
    used = sum(b.ref_count > 0 for b in snap.blocks)
    assert snap.num_free_blocks == snap.num_blocks - used
    assert snap.usage == pytest.approx(used / snap.num_blocks)


def test_kv_layout_bytes_match_cache_shape(llm):
    snap = llm.inspect()
    cfg = llm.hf_config
    L, Hkv, D = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
    elem = 4                                                        # fp32 on the CPU
    kv = snap.kv_layout
    assert kv.shape == (2, L, NUM_BLOCKS, BLOCK, Hkv, D)
    assert kv.dtype == "float32"
    assert kv.bytes_per_block == 2 * L * BLOCK * Hkv * D * elem
    assert kv.bytes_per_token == kv.bytes_per_block // BLOCK
    assert kv.total_bytes == NUM_BLOCKS * kv.bytes_per_block
    assert (snap.num_layers, snap.num_heads, snap.num_kv_heads) == (
        L, cfg.num_attention_heads, Hkv)
    assert snap.block_size == BLOCK and snap.num_blocks == NUM_BLOCKS and snap.tp_size == 1
    assert snap.moe is None


def test_mid_stream_blocks_hold_the_computed_tokens_and_share_the_prefix(llm):
    shared = prompt(1, 2 * BLOCK)                   # two full blocks both requests start with
    pa, pb = shared + prompt(2, 5), shared + prompt(3, 3)
    hits_before = llm.inspect().prefix_hits
    a = llm.stream(pa, greedy(MAX_TOKENS))
    first_a = next(a)                               # a's prompt is computed and committed
    b = llm.stream(pb, greedy(MAX_TOKENS))
    first_b = next(b)                               # b was admitted with a prefix hit
    ra, rb = first_a.request_id, first_b.request_id
    # snapshots at several moments while both decode, until each request has been seen
    # with a partly filled last block (where a wrongly included newest token would show)
    snaps, partial = [], set()
    while len(snaps) < 200 and (len(partial) < 2 or len(snaps) < 5):
        snap = llm.inspect()
        if not {ra, rb} <= set(snap.running):
            break
        # a block's tokens are read on demand (never copied into a snapshot): read them now,
        # while the request still holds the block; they start with what the snapshot saw
        snap.texts = {bid: llm.block_info(bid).token_ids
                      for rid in (ra, rb) for bid in snap.block_tables[rid]}
        snaps.append(snap)
        partial |= {r for r in (ra, rb) if computed_tokens(snap, r) % BLOCK}
        time.sleep(0.001)
    outs = {ra: [first_a.token_id], rb: [first_b.token_id]}
    for rid, gen in ((ra, a), (rb, b)):
        outs[rid] += [ev.token_id for ev in gen if ev.token_id is not None]
    assert len(outs[ra]) == len(outs[rb]) == MAX_TOKENS
    assert partial == {ra, rb}, "the engine finished before the snapshots saw every case"

    for snap in snaps:                              # each a consistent picture mid-decode
        assert_block_accounting(snap)
        assert snap.prefix_hits - hits_before == 2
        for bid in snap.block_tables[rb][:2]:       # the shared prefix: one copy, two owners
            blk = snap.blocks[bid]
            assert blk.ref_count == 2 and sorted(blk.owners) == sorted([ra, rb])
            assert snap.block_hashed[bid] and not blk.evictable
        assert snap.block_tables[ra][:2] == snap.block_tables[rb][:2]
        for rid, p in ((ra, pa), (rb, pb)):
            seq = p + outs[rid]
            n = computed_tokens(snap, rid)
            assert snap.request_tokens[rid] == n
            assert n >= len(p)                      # the prompt is computed (decoding)
            table = snap.block_tables[rid]
            held = [t for bid in table
                    for t in snap.texts[bid][:snap.blocks[bid].num_filled]]
            # every computed token, in order; the newest sampled token has no K/V yet
            assert held == seq[:n]
            assert -(-n // BLOCK) <= len(table) <= -(-(n + 1) // BLOCK)
            for bid in table[:-1]:
                assert snap.blocks[bid].num_filled == BLOCK

    # after both finish: nothing is held, and full computed blocks stay cached but free
    after = llm.inspect()
    assert_block_accounting(after)
    assert after.block_tables == {} and after.running == [] and after.waiting == []
    assert after.num_free_blocks == NUM_BLOCKS and after.usage == 0.0
    for blk in after.blocks:
        if blk.evictable:
            assert blk.ref_count == 0 and after.block_hashed[blk.block_id]
            assert blk.num_filled == BLOCK
    infos = [llm.block_info(blk.block_id) for blk in after.blocks if blk.evictable]
    assert all(i.evictable and i.prefix_hash is not None for i in infos)
    cached = {tuple(i.token_ids) for i in infos}
    for rid, p in ((ra, pa), (rb, pb)):
        seq = p + outs[rid]
        n = len(seq) - 1                            # the last sampled token was never computed
        for i in range(n // BLOCK):
            assert tuple(seq[i * BLOCK:(i + 1) * BLOCK]) in cached, (rid, i)


def test_steps_record_prefill_chunks_then_decodes(llm):
    # 20 prompt tokens with a budget of 16 per step: two prefill chunks, then decodes
    before = llm.inspect().steps[-1].step_id if llm.inspect().steps else -1
    out = llm.generate([prompt(4, 20)], greedy(4))[0]
    steps = [st for st in llm.inspect().steps if st.step_id > before]
    ids = [st.step_id for st in steps]
    assert ids == list(range(before + 1, before + 1 + len(ids)))
    mine = [(e.kind, e.num_tokens, e.start_pos) for st in steps for e in st.entries
            if e.request_id == out.request_id]
    # 4 sampled tokens: the last needs no forward of its own
    assert mine == [("prefill", 16, 0), ("prefill", 4, 16), ("decode", 1, 20),
                    ("decode", 1, 21), ("decode", 1, 22)]
    for st in steps:
        assert st.num_prefill_tokens == sum(e.num_tokens for e in st.entries
                                            if e.kind == "prefill")
        assert st.num_decode_tokens == sum(e.num_tokens for e in st.entries
                                           if e.kind == "decode")
        assert min(st.t_schedule, st.t_prepare, st.t_forward, st.t_sample) >= 0
        assert st.wall_time > 0 and 0.0 <= st.kv_usage <= 1.0
        assert st.graph_bucket is None              # eager on the CPU
        assert st.expert_load is None               # a dense model
        assert st.num_running >= 0 and st.num_waiting >= 0


def test_abort_mid_stream_frees_every_block(llm):
    gen = llm.stream(prompt(5, 9), greedy(200))
    rid = next(gen).request_id
    assert rid in llm.inspect().block_tables
    gen.close()                                     # closing the stream aborts the request
    snap = llm.inspect()
    assert rid not in snap.block_tables and rid not in snap.running
    assert_block_accounting(snap)
    assert snap.num_free_blocks == NUM_BLOCKS


def test_a_snapshot_handed_out_never_changes_while_the_engine_runs_on(llm):
    """A snapshot's per-block arrays, held by a reader (itself or through a view), are never
    written again by later copies or steps while requests allocate and free blocks."""
    held, frozen, views = [], [], []
    stop = []

    def reader():
        k = 0
        while not stop:
            s = llm.inspect()
            k += 1
            if k % 7 == 0 and len(held) < 6:        # keep a few, with what they said then
                held.append(s)
                frozen.append((s.block_ref.copy(), s.block_hashed.copy()))
            elif k % 11 == 0 and len(views) < 3:    # a view alone keeps its buffer too
                views.append((s.block_ref[1:], s.block_ref[1:].copy()))
            del s
            time.sleep(0.001)

    import threading
    t = threading.Thread(target=reader)
    t.start()
    try:
        llm.generate([prompt(40 + i, 10 + 7 * i) for i in range(4)], greedy(30))
    finally:
        stop.append(True)
        t.join()
    assert held and views
    for s, (ref, hashed) in zip(held, frozen):
        assert np.array_equal(s.block_ref, ref) and np.array_equal(s.block_hashed, hashed)
    for v, want in views:
        assert np.array_equal(v, want)
    assert any(not np.array_equal(ref, llm.inspect().block_ref) for ref, _ in frozen), \
        "the engine's blocks never changed while the snapshots were held: nothing was tested"
