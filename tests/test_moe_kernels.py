"""MoE routing, expert alignment and both expert paths (GEMV decode path, grouped GEMM path) on CPU
(Triton interpreter) vs torch and HF transformers."""

import functools

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen2MoeConfig, Qwen3MoeConfig
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from engine.kernels.fused_moe import (fused_moe, fused_moe_ref, grouped_w13_silu, grouped_w2_weighted,
                                      moe_sum, w13_silu_ref, w2_weighted_ref)
from engine.kernels.moe_configs import KernelTile, MoEGemvConfig, MoEKernelConfig
from engine.kernels.moe_gemv import fused_moe_gemv, gemv_w13_silu, gemv_w2_sum
from engine.kernels.moe_align import _moe_align_torch, _moe_align_triton, moe_align, moe_align_ref
from engine.kernels.moe_routing import FUSED_MAX_TOKENS, _route_triton, route, route_counts, route_hidden, route_ref

E, K, H, I = 8, 2, 32, 16
TOKENS = [1, 7, 33]
# CPU tensors through Triton: the interpreter, which tests/conftest.py turns on for the whole
# process before anything imports triton (never this module: import order must not matter)
pytestmark = pytest.mark.usefixtures("triton_interpreter")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _moe_inputs(n, dtype, seed, hidden=H, inter=I, experts=E, top_k=K, norm=True):
    g = _gen(seed)
    x = torch.randn(n, hidden, generator=g).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=g) / inter**0.5).to(dtype)
    _, topk_weights, topk_ids = route(torch.randn(n, experts, generator=g), top_k, norm)
    return x, w13, w2, topk_weights, topk_ids


# ---------------------------------------------------------------- routing


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("n", TOKENS)
def test_route_equals_reference_and_handwritten_softmax_topk(n, norm, dtype):
    logits = (2 * torch.randn(n, E, generator=_gen(n))).to(dtype)
    probs, w, ids = route(logits, K, norm)
    probs_r, w_r, ids_r = route_ref(logits, K, norm)
    assert probs.dtype == w.dtype == torch.float32 and ids.dtype == torch.int32
    assert probs.shape == (n, E) and w.shape == ids.shape == (n, K)
    assert torch.equal(probs, probs_r) and torch.equal(w, w_r) and torch.equal(ids, ids_r)

    z = logits.float()
    hand = torch.exp(z - z.max(-1, keepdim=True).values)
    hand = hand / hand.sum(-1, keepdim=True)
    top = hand.sort(-1, descending=True).values[:, :K]
    torch.testing.assert_close(probs, hand, rtol=1e-6, atol=1e-7)
    # tie-agnostic: the chosen experts carry the k largest probabilities, in descending order
    torch.testing.assert_close(hand.gather(1, ids.long()), top, rtol=1e-6, atol=1e-7)
    want = top / top.sum(-1, keepdim=True) if norm else top
    torch.testing.assert_close(w, want, rtol=1e-5, atol=1e-7)
    assert len(set(ids.flatten().tolist())) <= E and all(len(set(r)) == K for r in ids.tolist())


def test_route_breaks_ties_like_torch_topk():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0, -1.0, 2.0, 2.0]] * 3, dtype=torch.float16)
    _, w, ids = route(logits, 4, False)
    want_w, want_ids = torch.topk(torch.softmax(logits, -1, dtype=torch.float), 4)
    assert torch.equal(ids.long(), want_ids) and torch.equal(w, want_w)


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("n,experts,top_k", [(1, 8, 2), (33, 8, 2), (5, 60, 4), (19, 128, 8)])
def test_route_triton_kernel_matches_reference(n, experts, top_k, norm):
    logits = 2 * torch.randn(n, experts, generator=_gen(n + experts))  # fp32: no ties
    probs, w, ids = _route_triton(logits, top_k, norm)
    probs_r, w_r, ids_r = route_ref(logits, top_k, norm)
    assert probs.dtype == w.dtype == torch.float32 and ids.dtype == torch.int32
    torch.testing.assert_close(probs, probs_r, rtol=1e-5, atol=1e-7)
    assert torch.equal(ids, ids_r)
    torch.testing.assert_close(w, w_r, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("triton_path", [False, True])
def test_route_writes_into_given_buffers(triton_path):
    """The probes hand route() slices of their stacked per-layer buffers: the results must land
    there, equal to a fresh route, and leave the rest of the buffer alone."""
    n, experts, top_k = 7, 16, 4
    logits = 2 * torch.randn(n, experts, generator=_gen(99))
    probs_all = torch.full((2, 9, experts), -5.0)
    w_all = torch.full((2, 9, top_k), -5.0)
    ids_all = torch.full((2, 9, top_k), -5, dtype=torch.int32)
    out = (probs_all[1, :n], w_all[1, :n], ids_all[1, :n])
    got = _route_triton(logits, top_k, True, out) if triton_path else route(logits, top_k, True, out)
    want = route_ref(logits, top_k, True)
    for g, o, w in zip(got, out, want):
        assert g.data_ptr() == o.data_ptr()
        torch.testing.assert_close(o, w.to(o.dtype), rtol=1e-5, atol=1e-7)
    assert (probs_all[0] == -5).all() and (probs_all[1, n:] == -5).all()
    assert (ids_all[0] == -5).all() and (w_all[1, n:] == -5).all()
    with pytest.raises(ValueError, match="contiguous"):
        route(logits, top_k, True, (probs_all[1, :n, :8], w_all[1, :n], ids_all[1, :n]))


def test_route_triton_kernel_breaks_ties_toward_lower_expert():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0, -1.0, 2.0, 2.0]] * 3, dtype=torch.float16)
    _, w, ids = _route_triton(logits, 4, False)
    assert ids.tolist() == [[1, 2, 4, 6]] * 3
    want_w = torch.topk(torch.softmax(logits, -1, dtype=torch.float), 4).values
    torch.testing.assert_close(w, want_w, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("norm", [True, False])
def test_route_triton_kernel_with_many_ties_orders_like_a_stable_sort(norm):
    """Integer-valued fp16 logits over 40 experts: most of the top-k boundary is ties. The chosen
    experts and their slots are exactly a stable descending sort of the logits."""
    n, experts, top_k = 9, 40, 6
    logits = torch.randint(-3, 3, (n, experts), generator=_gen(7)).to(torch.float16)
    probs, w, ids = _route_triton(logits, top_k, norm)
    want_ids = torch.sort(logits.float(), dim=-1, descending=True, stable=True).indices[:, :top_k]
    assert torch.equal(ids.long(), want_ids)
    want_w = probs.gather(1, want_ids)
    if norm:
        want_w = want_w / want_w.sum(-1, keepdim=True)
    torch.testing.assert_close(w, want_w, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(probs, torch.softmax(logits.float(), -1), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("norm", [True, False])
def test_route_matches_hf_qwen3_moe_router(norm):
    block = _hf_qwen3_block(norm, seed=3)
    x = torch.randn(33, H, generator=_gen(4))
    logits_hf, w_hf, ids_hf = block.gate(x)
    _, w, ids = route(F.linear(x, block.gate.weight), K, norm)
    assert torch.equal(ids.long(), ids_hf)
    assert torch.equal(w.to(logits_hf.dtype), w_hf)  # HF casts the weights to the logits' dtype


@pytest.mark.parametrize("n,experts,top_k,hidden,norm,dtype", [
    (1, 16, 4, 40, True, torch.float32), (1, 16, 4, 40, False, torch.float16),
    (5, 60, 4, 64, False, torch.float32), (5, 60, 4, 64, True, torch.float16),
    (19, 40, 8, 48, True, torch.float32), (19, 40, 8, 48, False, torch.float16),
])
def test_route_hidden_equals_router_linear_then_route(n, experts, top_k, hidden, norm, dtype):
    """Router GEMV + routing in one launch: the same logits (rounded to x's dtype, as F.linear's
    output) and so the same routing as the two-step path."""
    g = _gen(n + experts)
    x = torch.randn(n, hidden, generator=g).to(dtype)
    gate = (torch.randn(experts, hidden, generator=g) / hidden**0.5).to(dtype)
    counts = route_counts("cpu")
    probs, w, ids = route_hidden(x, gate, top_k, norm, counts)
    logits = F.linear(x.float(), gate.float()).to(dtype)
    probs_r, w_r, ids_r = route_ref(logits, top_k, norm)
    torch.testing.assert_close(probs, probs_r, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w, w_r, rtol=1e-5, atol=1e-6)
    if dtype == torch.float32:  # fp16 logits can tie, and then the order among the tied is free
        assert torch.equal(ids, ids_r)
    assert bool((counts == 0).all()), "the semaphores must reset for the next launch"
    again = route_hidden(x, gate, top_k, norm, counts)
    for a, b in zip(again, (probs, w, ids)):
        assert torch.equal(a, b)


def test_route_hidden_writes_into_given_buffers_and_checks_its_inputs():
    n, experts, top_k, hidden = 7, 16, 4, 32
    g = _gen(5)
    x, gate = torch.randn(n, hidden, generator=g), torch.randn(experts, hidden, generator=g)
    probs_all = torch.full((2, n, experts), -5.0)
    w_all = torch.full((2, n, top_k), -5.0)
    ids_all = torch.full((2, n, top_k), -5, dtype=torch.int32)
    out = (probs_all[1], w_all[1], ids_all[1])
    got = route_hidden(x, gate, top_k, True, route_counts("cpu"), out)
    for t, o, r in zip(got, out, route_ref(F.linear(x, gate), top_k, True)):
        assert t.data_ptr() == o.data_ptr()
        torch.testing.assert_close(o, r.to(o.dtype), rtol=1e-5, atol=1e-6)
    assert (probs_all[0] == -5).all() and (ids_all[0] == -5).all()
    too_many = torch.randn(FUSED_MAX_TOKENS + 1, hidden)
    with pytest.raises(ValueError, match="tokens"):
        route_hidden(too_many, gate, top_k, True, route_counts("cpu"))
    with pytest.raises(ValueError, match="share H"):
        route_hidden(x, gate[:, :-1], top_k, True, route_counts("cpu"))


# ---------------------------------------------------------------- alignment


def _check_align(topk_ids, block_m, sorted_ids, expert_ids, ntpp):
    flat = topk_ids.flatten().long()
    m = flat.numel()
    max_padded = m + E * (block_m - 1)
    assert sorted_ids.dtype == expert_ids.dtype == ntpp.dtype == torch.int32
    assert sorted_ids.shape == (max_padded,) and expert_ids.shape == (-(-max_padded // block_m),)
    assert ntpp.shape == (1,)
    counts = torch.bincount(flat, minlength=E)
    total = int(((counts + block_m - 1) // block_m * block_m).sum())
    assert int(ntpp) == total and total % block_m == 0

    real = sorted_ids[:total][sorted_ids[:total] < m].long()
    assert sorted(real.tolist()) == list(range(m)), "every (token, k) index exactly once"
    assert bool((sorted_ids[total:] == m).all()) and bool((sorted_ids >= 0).all())
    assert bool((expert_ids[total // block_m:] == -1).all())

    blocks = sorted_ids[:total].view(-1, block_m).long()
    block_experts = expert_ids[: total // block_m].tolist()
    assert block_experts == sorted(block_experts), "each expert's blocks are contiguous, ascending"
    for e in set(block_experts):
        run = blocks[torch.tensor(block_experts) == e].flatten()
        n_real = int(counts[e])
        assert bool((run[:n_real] < m).all()) and bool((run[n_real:] == m).all()), "sentinels only in padding"
        assert len(run) - n_real < block_m
        assert bool((flat[run[:n_real]] == e).all())
    assert set(block_experts) == set(flat.tolist())


def _routed_ids(n, seed, skew=False):
    g = _gen(seed)
    if skew:  # every token on experts 3 and 5: runs longer than one block
        return torch.tensor([[3, 5]] * n, dtype=torch.int32)
    return torch.argsort(torch.rand(n, E, generator=g), dim=-1)[:, :K].to(torch.int32)


ALIGN_IMPLS = {
    "public": moe_align,
    "triton_single_launch": _moe_align_triton,
    "triton_chunked": functools.partial(_moe_align_triton, sub=16),
    "triton_chunked_multi_slice": functools.partial(_moe_align_triton, sub=16, max_chunks=2),
    "torch": _moe_align_torch,
}


@pytest.mark.parametrize("impl", ALIGN_IMPLS.values(), ids=ALIGN_IMPLS.keys())
@pytest.mark.parametrize("block_m", [4, 16])
@pytest.mark.parametrize("n,skew", [(1, False), (7, False), (33, False), (33, True), (16, True)])
def test_moe_align_groups_pads_and_covers_every_pair(impl, block_m, n, skew):
    topk_ids = _routed_ids(n, seed=n + block_m, skew=skew)
    got = impl(topk_ids, E, block_m)
    _check_align(topk_ids, block_m, *got)
    for a, b in zip(got, moe_align_ref(topk_ids, E, block_m)):
        assert torch.equal(a, b)


def test_moe_align_accepts_int64_ids_and_unused_experts():
    topk_ids = torch.tensor([[0, 7], [7, 2], [2, 0]], dtype=torch.int64)
    for impl in ALIGN_IMPLS.values():
        got = impl(topk_ids, E, 4)
        _check_align(topk_ids, 4, *got)
        assert got[1][:3].tolist() == [0, 2, 7]


# ---------------------------------------------------------------- fused experts


@pytest.mark.parametrize("n", TOKENS)
def test_fused_moe_matches_reference_fp32(n):
    x, w13, w2, w, ids = _moe_inputs(n, torch.float32, seed=10 + n)
    out = torch.full_like(x, float("nan"))
    got = fused_moe(x, w13, w2, w, ids, out=out)
    assert got is out
    torch.testing.assert_close(got, fused_moe_ref(x, w13, w2, w, ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n", TOKENS)
def test_fused_moe_matches_reference_fp16(n):
    x, w13, w2, w, ids = _moe_inputs(n, torch.float16, seed=20 + n)
    out = torch.full_like(x, float("nan"))
    fused_moe(x, w13, w2, w, ids, out=out)
    want = fused_moe_ref(x.float(), w13.float(), w2.float(), w, ids)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), want, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("cfg", [
    MoEKernelConfig(16, KernelTile(16, 16, 4, 2), KernelTile(16, 16, 4, 2)),
    MoEKernelConfig(32, KernelTile(32, 32, 4, 2, group_m=2), KernelTile(16, 32, 4, 2, group_m=2)),
    MoEKernelConfig(64, KernelTile(64, 64, 4, 2, group_m=8), KernelTile(64, 16, 4, 2, group_m=8)),
], ids=lambda c: c.short())
def test_fused_moe_any_tile_config_and_ragged_shapes(cfg):
    # H=40, I=24: neither a multiple of the K tile nor of the N tile, so every mask is exercised
    x, w13, w2, w, ids = _moe_inputs(19, torch.float32, seed=30, hidden=40, inter=24, top_k=3, norm=False)
    out = torch.full_like(x, float("nan"))
    fused_moe(x, w13, w2, w, ids, out=out, config=cfg)
    torch.testing.assert_close(out, fused_moe_ref(x, w13, w2, w, ids), rtol=1e-5, atol=1e-5)


def test_fused_moe_takes_bf16_cast_weights_and_allocates_output():
    x, w13, w2, w, ids = _moe_inputs(7, torch.float32, seed=40)
    got = fused_moe(x, w13, w2, w.half(), ids.long())
    torch.testing.assert_close(got, fused_moe_ref(x, w13, w2, w.half().float(), ids), rtol=1e-5, atol=1e-5)


def test_fused_moe_rejects_mismatched_shapes():
    x, w13, w2, w, ids = _moe_inputs(3, torch.float32, seed=41)
    with pytest.raises(ValueError, match="inconsistent"):
        fused_moe(x, w13, w2[:, :, :-1], w, ids)
    with pytest.raises(ValueError, match="top_k"):
        fused_moe(x, w13, w2, w[:, :1], ids)


# ---------------------------------------------------------------- GEMV (decode) path

# Small tiles so H=40 / I=24 leave a ragged last K chunk and a ragged N tile in both kernels.
GEMV_CONFIGS = {
    "small": MoEGemvConfig(KernelTile(8, 16, 1), KernelTile(16, 16, 1)),
    "one-row": MoEGemvConfig(KernelTile(1, 32, 1), KernelTile(1, 8, 1)),
    "wide": MoEGemvConfig(KernelTile(32, 64, 2), KernelTile(64, 32, 2)),
}
GEMV_TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=1e-2, atol=1e-2)}
# (tokens, config, dtype); "one-row" runs one program per row, slow in the interpreter: n=1 covers it
GEMV_CASES = [pytest.param(n, name, dtype, id=f"{n}-{name}-{str(dtype)[6:]}")
              for dtype in (torch.float32, torch.float16) for name in GEMV_CONFIGS for n in (1, 3)
              if name != "one-row" or n == 1]


@pytest.mark.parametrize("n, name, dtype", GEMV_CASES)
def test_gemv_w13_silu_matches_stage_reference(n, name, dtype):
    x, w13, _, _, ids = _moe_inputs(n, dtype, seed=70 + n, hidden=40, inter=24, top_k=3)
    inter = gemv_w13_silu(x, w13, ids, GEMV_CONFIGS[name].w13)
    assert inter.shape == (n * 3, 24) and inter.dtype == dtype
    torch.testing.assert_close(inter.float(), w13_silu_ref(x, w13, ids), **GEMV_TOL[dtype])


@pytest.mark.parametrize("n, name, dtype", GEMV_CASES)
def test_gemv_w2_sum_applies_weights_and_sums_over_k(n, name, dtype):
    _, _, w2, w, ids = _moe_inputs(n, dtype, seed=80 + n, hidden=40, inter=24, top_k=3, norm=False)
    inter = torch.randn(n * 3, 24, generator=_gen(81)).to(dtype)
    out = torch.full((n, 40), float("nan"), dtype=dtype)
    got = gemv_w2_sum(inter, w2, w, ids, GEMV_CONFIGS[name].w2, out)
    assert got is out
    want = w2_weighted_ref(inter, w2, w, ids).view(n, 3, 40).sum(1)
    torch.testing.assert_close(out.float(), want, **GEMV_TOL[dtype])


def test_stage_references_compose_to_the_moe_reference():
    x, w13, w2, w, ids = _moe_inputs(7, torch.float32, seed=85)
    y = w2_weighted_ref(w13_silu_ref(x, w13, ids), w2, w, ids)
    torch.testing.assert_close(y.view(7, K, H).sum(1), fused_moe_ref(x, w13, w2, w, ids), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n", TOKENS)
def test_fused_moe_gemv_matches_reference_fp32(n):
    x, w13, w2, w, ids = _moe_inputs(n, torch.float32, seed=90 + n)
    out = torch.full_like(x, float("nan"))
    got = fused_moe_gemv(x, w13, w2, w, ids, out=out, config=GEMV_CONFIGS["small" if n < 8 else "wide"])
    assert got is out
    torch.testing.assert_close(got, fused_moe_ref(x, w13, w2, w, ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n", [1, 7])
def test_fused_moe_gemv_matches_reference_fp16_with_fp32_routing_weights(n):
    """The router's fp32 weights go in as they are: the kernel rounds them to fp16 as HF does."""
    x, w13, w2, w, ids = _moe_inputs(n, torch.float16, seed=100 + n)
    assert w.dtype == torch.float32
    out = fused_moe_gemv(x, w13, w2, w, ids, config=GEMV_CONFIGS["wide"])
    want = fused_moe_ref(x.float(), w13.float(), w2.float(), w.half().float(), ids)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), want, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("path", ["gemv", "grouped"])
def test_expert_paths_never_read_inactive_experts(path):
    """Inactive experts' weights are NaN: one read of them would poison the output."""
    x, w13, w2, w, ids = _moe_inputs(5, torch.float32, seed=110, experts=16)
    active = torch.zeros(16, dtype=torch.bool)
    active[ids.long().flatten()] = True
    assert not active.all()
    want = fused_moe_ref(x, w13, w2, w, ids)
    w13[~active] = float("nan")
    w2[~active] = float("nan")
    if path == "gemv":
        got = fused_moe_gemv(x, w13, w2, w, ids, config=GEMV_CONFIGS["small"])
    else:
        got = fused_moe(x, w13, w2, w, ids, config=MoEKernelConfig(16, KernelTile(16, 16), KernelTile(16, 16)))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_fused_moe_gemv_rejects_mismatched_shapes():
    x, w13, w2, w, ids = _moe_inputs(3, torch.float32, seed=41)
    with pytest.raises(ValueError, match="inconsistent"):
        fused_moe_gemv(x, w13[:, :-2], w2, w, ids)


def test_grouped_stages_match_stage_references():
    x, w13, w2, w, ids = _moe_inputs(19, torch.float32, seed=120, hidden=40, inter=24, top_k=3, norm=False)
    aligned = moe_align(ids, E, 16)
    tile = KernelTile(16, 16, 4, 2)
    inter = grouped_w13_silu(x, w13, aligned, 19 * 3, 3, 16, tile)
    torch.testing.assert_close(inter, w13_silu_ref(x, w13, ids), rtol=1e-5, atol=1e-5)
    y = grouped_w2_weighted(inter, w2, w, aligned, 16, tile)
    want = w2_weighted_ref(inter, w2, w, ids)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
    out = moe_sum(y, torch.full_like(x, float("nan")), 3)
    torch.testing.assert_close(out, want.view(19, 3, 40).sum(1), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- vs HF transformers


def _hf_qwen3_block(norm, seed):
    cfg = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=K,
                         norm_topk_prob=norm, experts_implementation="eager")
    block = Qwen3MoeSparseMoeBlock(cfg).eval()
    g = _gen(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    return block


def _experts_weights(experts):
    # HF 5.x stores experts fused: gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I]
    return experts.gate_up_proj.detach(), experts.down_proj.detach()


@pytest.mark.parametrize("norm", [True, False])
def test_reference_matches_hf_qwen3_moe_block(norm):
    block = _hf_qwen3_block(norm, seed=50)
    x = torch.randn(1, 33, H, generator=_gen(51))
    with torch.no_grad():
        want = block(x)[0]
        _, w, ids = route(F.linear(x[0], block.gate.weight), K, norm)
        w13, w2 = _experts_weights(block.experts)
        got = fused_moe_ref(x[0], w13, w2, w, ids)
        fused = fused_moe(x[0], w13, w2, w, ids, out=torch.full_like(x[0], float("nan")))
        gemv = fused_moe_gemv(x[0], w13, w2, w, ids, config=GEMV_CONFIGS["wide"])
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(fused, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gemv, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("norm", [False, True])
def test_reference_plus_shared_expert_matches_hf_qwen2_moe_block(norm):
    cfg = Qwen2MoeConfig(hidden_size=H, moe_intermediate_size=I, shared_expert_intermediate_size=2 * I,
                         num_experts=E, num_experts_per_tok=K, norm_topk_prob=norm,
                         experts_implementation="eager")
    block = Qwen2MoeSparseMoeBlock(cfg).eval()
    g = _gen(60)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
        x = torch.randn(1, 7, H, generator=_gen(61))
        want = block(x)[0]
        h = x[0]
        _, w, ids = route(F.linear(h, block.gate.weight), K, norm)
        w13, w2 = _experts_weights(block.experts)
        shared = torch.sigmoid(block.shared_expert_gate(h)) * block.shared_expert(h)
        got = fused_moe_ref(h, w13, w2, w, ids) + shared
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
