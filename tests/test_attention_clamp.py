"""Intervention.clamp_attention without a model forward: validation and serialisation, the
recomputation over the chosen keys against a dense masked softmax over the whole paged context
(fresh random caches, prefill chunks and decode), and the per-step tables, eager and CUDA-graph
(on the CPU), which leave every other row's bits alone. The model-level checks against HF are
in test_interventions_vs_hf.py."""
from __future__ import annotations

import pytest
import torch

from engine import Intervention
from engine.context import ForwardContext
from engine.interventions.attention_clamp import clamped_attention, token_seq_and_pos
from engine.interventions.plan import InterventionPlanner
from engine.interventions.spec import (MAX_CLAMP_POSITIONS, cache_salt,
                                       resolve_interventions)
from test_interventions import DENSE as FACTS, _Sched, _Seq  # the planner's fakes

HQ, HKV, D, PAGE = 8, 2, 16, 4


# ---- the spec ------------------------------------------------------------------------------------
@pytest.mark.parametrize("make,words", [
    (lambda: Intervention.clamp_attention(0, [0], []), "positions must be a non-empty list"),
    (lambda: Intervention.clamp_attention(0, [], [1]), "heads must be a non-empty list"),
    (lambda: Intervention.clamp_attention(0, [0], [-1, 2]), "absolute token positions"),
    (lambda: Intervention.clamp_attention(0, [0], list(range(MAX_CLAMP_POSITIONS + 1))),
     f"at most {MAX_CLAMP_POSITIONS}"),
    (lambda: Intervention.clamp_attention("1", [0], [1]), "layer must be an integer"),
])
def test_bad_clamps_fail_at_construction(make, words):
    with pytest.raises(ValueError, match=words):
        make()


def test_resolve_checks_heads_and_one_key_set_per_layer():
    with pytest.raises(ValueError, match=r"clamp_attention\): heads \[8\] are out of range"):
        resolve_interventions([Intervention.clamp_attention(0, [8], [1])], FACTS)
    with pytest.raises(ValueError, match=r"interventions\[1\].*already clamped to positions \[1, 2\]"):
        resolve_interventions([Intervention.clamp_attention(0, [1], [1, 2]),
                               Intervention.clamp_attention(-4, [2], [3])], FACTS)
    got = resolve_interventions([Intervention.clamp_attention(-1, [3, 1], [5, 0, 5])], FACTS)
    assert (got[0].layer, got[0].heads, got[0].key_positions) == (3, (1, 3), (0, 5))


def test_clamp_round_trips_and_keys_the_prefix_cache():
    iv = Intervention.clamp_attention(1, [0, 2], [0, 4])
    d = iv.to_dict()
    assert d == {"kind": "clamp_attention", "layer": 1, "heads": [0, 2], "positions": [0, 4]}
    assert Intervention.from_dict(d).key() == iv.key()
    with pytest.raises(ValueError, match="needs the field 'positions'"):
        Intervention.from_dict({"kind": "clamp_attention", "layer": 1, "heads": [0]})
    salts = {cache_salt(resolve_interventions(ivs, FACTS)) for ivs in (
        [iv], [Intervention.clamp_attention(1, [0, 2], [0, 5])],
        [Intervention.clamp_attention(1, [0], [0, 4])], [Intervention.clamp_attention(2, [0, 2], [0, 4])],
        [Intervention.ablate_heads(1, [0, 2])])}
    assert len(salts) == 5 and None not in salts


# ---- the recomputation vs a dense reference ----------------------------------------------------
def _paged(seq_lens, seed):
    """Random K/V caches and a shuffled block table holding sequences of these lengths."""
    g = torch.Generator().manual_seed(seed)
    widths = [-(-n // PAGE) for n in seq_lens]
    nblocks = sum(widths) + 3
    k = torch.randn(nblocks, PAGE, HKV, D, generator=g)
    v = torch.randn(nblocks, PAGE, HKV, D, generator=g)
    perm = torch.randperm(nblocks, generator=g).tolist()
    tables = torch.zeros(len(seq_lens), max(widths), dtype=torch.int32)
    for b, w in enumerate(widths):
        tables[b, :w] = torch.tensor([perm.pop() for _ in range(w)])
    return k, v, tables


def _dense_clamped(q, k_cache, v_cache, table, pos, keys, scale):
    """One query [Hq, D] at absolute position pos over its whole context 0..pos, every key not
    in `keys` masked to -inf before the softmax; zeros when none is left."""
    ctx = pos + 1
    blocks = table[: -(-ctx // PAGE)].long()
    k = k_cache[blocks].flatten(0, 1)[:ctx].repeat_interleave(HQ // HKV, dim=1)   # [ctx, Hq, D]
    v = v_cache[blocks].flatten(0, 1)[:ctx].repeat_interleave(HQ // HKV, dim=1)
    s = torch.einsum("hd,thd->ht", q, k) * scale
    allow = torch.zeros(ctx, dtype=torch.bool)
    allow[[p for p in keys if 0 <= p <= pos]] = True
    if not allow.any():
        return torch.zeros(HQ, D)
    p = torch.softmax(s.masked_fill(~allow, float("-inf")), dim=-1)
    return torch.einsum("ht,thd->hd", p, v)


def _check_step(ctx, k, v, seq_keys, scale=0.3, seed=0):
    n = int(ctx.cu_seqlens_q[-1]) if not ctx.is_decode else ctx.context_lens.shape[0]
    q = torch.randn(n, HQ, D, generator=torch.Generator().manual_seed(seed))
    seq, pos = token_seq_and_pos(ctx, n, q.device)
    width = max(len(x) for x in seq_keys)
    keys = torch.full((n, width), -1, dtype=torch.long)
    for t in range(n):
        ks = seq_keys[int(seq[t])]
        keys[t, :len(ks)] = torch.tensor(ks)
    got = clamped_attention(q, k, v, ctx.block_tables, seq, pos, keys, scale)
    for t in range(n):
        want = _dense_clamped(q[t], k, v, ctx.block_tables[int(seq[t])], int(pos[t]),
                              seq_keys[int(seq[t])], scale)
        torch.testing.assert_close(got[t], want, atol=1e-5, rtol=1e-5)
    return got, pos


def test_prefill_chunks_attend_only_to_their_chosen_keys():
    # sequence 0: a whole prompt of 9; sequence 1: a chunk of 5 after 7 cached tokens (12 total)
    k, v, tables = _paged([9, 12], seed=1)
    ctx = ForwardContext(slot_mapping=torch.zeros(14, dtype=torch.long),
                         context_lens=torch.tensor([9, 12], dtype=torch.int32), block_tables=tables,
                         cu_seqlens_q=torch.tensor([0, 9, 14], dtype=torch.int32), max_seqlen_q=9,
                         is_decode=False)
    got, pos = _check_step(ctx, k, v, [[2, 5, 8], [0, 9, 11, 40]])
    assert pos.tolist() == list(range(9)) + [7, 8, 9, 10, 11]
    assert (got[:2] == 0).all(), "queries before the first chosen key see nothing: zeros"


def test_decode_rows_attend_only_to_their_chosen_keys():
    k, v, tables = _paged([6, 13, 1], seed=2)
    ctx = ForwardContext(slot_mapping=torch.zeros(3, dtype=torch.long),
                         context_lens=torch.tensor([6, 13, 1], dtype=torch.int32), block_tables=tables,
                         cu_seqlens_q=None, max_seqlen_q=1, is_decode=True)
    _check_step(ctx, k, v, [[0, 5], [3, 12, 7], [0]], seed=3)


# ---- the tables: only the clamping request's chosen heads change -------------------------------
def _decode_step(k, v, tables, lens):
    return ForwardContext(slot_mapping=torch.zeros(len(lens), dtype=torch.long),
                          context_lens=torch.tensor(lens, dtype=torch.int32), block_tables=tables,
                          cu_seqlens_q=None, max_seqlen_q=1, is_decode=True)


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_tables_clamp_only_the_chosen_heads_of_the_clamping_request(graph):
    from engine.interventions.buffers import GraphInterventionBuffers, InterventionBuffers
    clamp = Intervention.clamp_attention(2, [1, 6], [0, 3])
    a, plain = _Seq([clamp], 4), _Seq([], 3)
    planner = InterventionPlanner(FACTS)
    planner.add(a)
    k, v, tables = _paged([7, 9], seed=4)
    plan = planner.plan([_Sched(plain, 6, 1), _Sched(a, 8, 1)])
    assert plan.key == ((), (), (), (2,))
    if graph:
        g = GraphInterventionBuffers(plan.key, 8, FACTS, torch.device("cpu"), torch.float32,
                                     slice(0, HQ))
        g.load_plan(plan)
        bufs = g.view(2)
    else:
        bufs = InterventionBuffers(plan, torch.device("cpu"), torch.float32, slice(0, HQ))
    ctx = _decode_step(k, v, tables, [7, 9])
    q, o = torch.randn(2, HQ, D), torch.randn(2, HQ, D)
    assert bufs.clamp(1, q, o, k, v, ctx, 0.25) is o
    out = bufs.clamp(2, q, o, k, v, ctx, 0.25)
    others = [h for h in range(HQ) if h not in (1, 6)]
    assert torch.equal(out[0], o[0]) and torch.equal(out[1, others], o[1, others])
    want = _dense_clamped(q[1], k, v, tables[1], 8, [0, 3], 0.25)
    torch.testing.assert_close(out[1, [1, 6]], want[[1, 6]], atol=1e-5, rtol=1e-5)
