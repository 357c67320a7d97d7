"""GPU: kernels launched with programmatic dependent launch (engine/kernels/pdl.py) still see
their predecessor's output, eagerly and replayed from a CUDA graph.

A decode layer's chain (fused add + RMSNorm -> skinny GEMM -> SiLU*mul -> skinny GEMM, split-K
included) runs 28 times back to back, each kernel reading what the one before it wrote a
moment earlier; a kernel that read its input before its wait, or stored before it, would read
stale or half-written rows and the result would drift from the same chain with PDL off
(`pdl=False`, what KernelConfig(pdl=False) gives every launcher)."""
import pytest
import torch

from engine.kernels.activation import silu_and_mul
from engine.kernels.rmsnorm import fused_add_rms_norm
from engine.kernels.pdl import use_pdl
from engine.kernels.skinny_gemm import SkinnyConfig, skinny_linear

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

H, I, LAYERS = 1024, 3072, 28


def _weights(seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device="cuda") * scale).to(torch.bfloat16)
    return [(rnd(H, scale=0.2) + 1, rnd(2 * I, H, scale=H ** -0.5), rnd(H, I, scale=I ** -0.5))
            for _ in range(LAYERS)]


def _chain(x, residual, weights, split_down, pdl=True):
    down_cfg = SkinnyConfig(2, 512, 3, 4, 3) if split_down else None  # split-K: a reduce launch too
    for norm_w, gate_up, down in weights:
        h, residual = fused_add_rms_norm(x, residual, norm_w, 1e-6, pdl=pdl)
        x = skinny_linear(silu_and_mul(skinny_linear(h, gate_up, pdl=pdl), pdl), down,
                          config=down_cfg, pdl=pdl)
    return x, residual


def _skip_without_pdl():
    if not use_pdl(torch.empty(1, device="cuda")):
        pytest.skip("PDL needs sm_90+")


@pytest.mark.parametrize("split_down", [False, True])
def test_pdl_chain_matches_the_chain_without_pdl(split_down):
    _skip_without_pdl()
    weights = _weights(1)
    x0 = torch.randn(1, H, device="cuda").to(torch.bfloat16)
    r0 = torch.randn(1, H, device="cuda").to(torch.bfloat16)
    with_pdl = _chain(x0, r0, weights, split_down)
    without = _chain(x0, r0, weights, split_down, pdl=False)
    torch.testing.assert_close(with_pdl[0], without[0], rtol=0, atol=0)
    torch.testing.assert_close(with_pdl[1], without[1], rtol=0, atol=0)


def test_pdl_chain_replays_from_a_cuda_graph_with_new_inputs():
    weights = _weights(2)
    x = torch.randn(1, H, device="cuda").to(torch.bfloat16)
    r = torch.randn(1, H, device="cuda").to(torch.bfloat16)
    _chain(x, r, weights, True)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, res = _chain(x, r, weights, True)
    for seed in range(3):
        g = torch.Generator(device="cuda").manual_seed(100 + seed)
        x.copy_(torch.randn(1, H, generator=g, device="cuda"))
        r.copy_(torch.randn(1, H, generator=g, device="cuda"))
        graph.replay()
        want = _chain(x, r, weights, True, pdl=False)  # eager, PDL off
        torch.testing.assert_close(out, want[0], rtol=0, atol=0)
        torch.testing.assert_close(res, want[1], rtol=0, atol=0)


def _bf16(g, *shape, scale=1.0, shift=0.0):
    return (torch.randn(*shape, generator=g, device="cuda") * scale + shift).to(torch.bfloat16)


@pytest.mark.parametrize("N,K", [(4096, 1024), (6144, 1024), (5120, 2048)])  # 0.6B qkv, gate_up; 30B qkv
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("factored", [False, True], ids=["prepass", "factored"])
def test_fused_norm_gemv_matches_the_two_kernels_in_bf16(N, K, with_residual, factored):
    from engine.kernels.rmsnorm import fused_add_rms_norm, rms_norm
    from engine.kernels.skinny_gemm import rms_norm_linear
    g = torch.Generator(device="cuda").manual_seed(N + K + with_residual)
    x, res = _bf16(g, 1, K, scale=4.0), _bf16(g, 1, K, scale=4.0) if with_residual else None
    norm_w, w = _bf16(g, K, scale=0.3, shift=1.0), _bf16(g, N, K, scale=K ** -0.5)
    sumsq, want_sumsq = torch.zeros(1, device="cuda"), torch.zeros(1, device="cuda")
    out, resid = rms_norm_linear(x, w, norm_w, 1e-6, res, None, sumsq, factored=factored)
    if with_residual:
        h, want_resid = fused_add_rms_norm(x, res, norm_w, 1e-6, want_sumsq)
    else:
        h, want_resid = rms_norm(x, norm_w, 1e-6, want_sumsq), x
    want = skinny_linear(h, w)
    torch.testing.assert_close(resid, want_resid, rtol=0, atol=0)
    torch.testing.assert_close(sumsq, want_sumsq, rtol=1e-5, atol=0)
    # prepass: the only difference is the order of the fp32 sum of squares (a normed value may
    # round to the neighbouring bf16 now and then); factored: the 1/rms scale is applied after
    # the product, so x * rstd is never rounded. Either moves an output by ~1e-2 at most
    torch.testing.assert_close(out.float(), want.float(), rtol=2e-2, atol=2e-2)
    if not factored:
        assert (out == want).float().mean() > 0.9
    err = (out.float() - want.float()).abs().mean() / want.float().abs().mean()
    assert err < 4e-3  # on average within a bf16 ulp


@pytest.mark.parametrize("N,K", [(6144, 1024), (2 * 9728, 2560)])  # 0.6B, 4B gate_up
@pytest.mark.parametrize("factored", [False, True], ids=["prepass", "factored"])
def test_gated_fused_norm_gemv_matches_the_three_kernels_in_bf16(N, K, factored):
    """The dense MLP's batch-1 gate_up with SiLU * up in its epilogue against norm, GEMV and
    silu_and_mul launched apart."""
    from engine.kernels.activation import silu_and_mul
    from engine.kernels.rmsnorm import fused_add_rms_norm
    from engine.kernels.skinny_gemm import rms_norm_linear
    g = torch.Generator(device="cuda").manual_seed(N + K + factored)
    x, res = _bf16(g, 1, K, scale=4.0), _bf16(g, 1, K, scale=4.0)
    norm_w, w = _bf16(g, K, scale=0.3, shift=1.0), _bf16(g, N, K, scale=2 * K ** -0.5)
    act, resid = rms_norm_linear(x, w, norm_w, 1e-6, res, factored=factored, gated=True)
    h, want_resid = fused_add_rms_norm(x, res, norm_w, 1e-6)
    want = silu_and_mul(skinny_linear(h, w))
    assert act.shape == (1, N // 2)
    torch.testing.assert_close(resid, want_resid, rtol=0, atol=0)
    # Against exact SwiGLU (fp64 from the same bf16 inputs), the fused kernel is as close as the
    # three kernels are. (Compared with each other they differ by a few bf16 ulps where |gate| and
    # |up| are both large: silu(gate) * up multiplies the product's rounding differences.)
    s = x.double() + res.double()
    gu = (s / torch.sqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6) * norm_w.double()) @ w.double().T
    exact = torch.nn.functional.silu(gu[:, :N // 2]) * gu[:, N // 2:]
    err_fused, err_apart = (act.double() - exact).abs(), (want.double() - exact).abs()
    assert err_fused.mean() <= 1.25 * err_apart.mean()
    assert err_fused.max() <= 2.0 * err_apart.max()
    if not factored:  # the same rounding points: equal but for the sum of squares' order
        assert (act == want).float().mean() > 0.9


# Qwen3-30B-A3B's expert shapes (scaled down in E so the test stays small): the batch-1 MoE chain
# norm -> fused router (GEMV + top-k in one launch) -> w13+SiLU GEMV -> w2 GEMV, each kernel
# launched with PDL and each reading what the one before wrote.
MOE_H, MOE_I, MOE_E, MOE_K, MOE_LAYERS = 2048, 768, 32, 8, 12


def _moe_weights(seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [(_bf16(g, MOE_H, scale=0.2, shift=1.0), _bf16(g, MOE_E, MOE_H, scale=MOE_H ** -0.5),
             _bf16(g, MOE_E, 2 * MOE_I, MOE_H, scale=MOE_H ** -0.5),
             _bf16(g, MOE_E, MOE_H, MOE_I, scale=MOE_I ** -0.5)) for _ in range(MOE_LAYERS)]


def _moe_chain(x, residual, weights, counts, pdl=True):
    from engine.kernels.moe_gemv import fused_moe_gemv
    from engine.kernels.moe_routing import route_hidden
    for norm_w, gate, w13, w2 in weights:
        h, residual = fused_add_rms_norm(x, residual, norm_w, 1e-6, pdl=pdl)
        _, topk_w, topk_ids = route_hidden(h, gate, MOE_K, True, counts, pdl=pdl)
        x = fused_moe_gemv(h, w13, w2, topk_w, topk_ids, pdl=pdl)
    return x, residual


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_pdl_moe_chain_matches_the_chain_without_pdl(graph):
    from engine.kernels.moe_routing import route_counts
    _skip_without_pdl()
    weights, counts = _moe_weights(3), route_counts("cuda")
    g = torch.Generator(device="cuda").manual_seed(7)
    x, r = _bf16(g, 1, MOE_H), _bf16(g, 1, MOE_H)
    got = _moe_chain(x, r, weights, counts)  # also compiles outside any capture
    if graph:
        cuda_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cuda_graph):
            got = _moe_chain(x, r, weights, counts)
    for seed in range(3 if graph else 1):
        if graph:  # new inputs each replay: different experts every layer
            x.copy_(_bf16(g, 1, MOE_H))
            r.copy_(_bf16(g, 1, MOE_H))
            cuda_graph.replay()
        want = _moe_chain(x, r, weights, counts, pdl=False)
        torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
        torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)


# Decode attention reads its first tile of K/V before its PDL wait, all but the newest token's,
# which the kernel just before it (q/k norm + RoPE + K/V store) is writing at that moment and
# which it re-reads after the wait. Each replay first fills the newest slots with garbage: an
# attention that kept a pre-wait read of them would attend to it.
ATT_HQ, ATT_HKV, ATT_D, ATT_LAYERS, ATT_PAGE = 16, 8, 128, 8, 16


@pytest.mark.parametrize("batch,num_splits", [(1, None), (1, 1), (3, None), (3, 4)])
def test_pdl_attention_sees_the_newest_token_written_just_before(batch, num_splits):
    from engine.kernels.decode_attention import paged_decode_attention
    from engine.kernels.qk_norm_rope_store import qk_norm_rope_store
    from engine.kernels.rotary import build_cos_sin_cache
    _skip_without_pdl()
    g = torch.Generator(device="cuda").manual_seed(11 + batch)
    width, width_qkv = 64, (ATT_HQ + 2 * ATT_HKV) * ATT_D
    num_blocks = batch * width + 3
    caches = [(_bf16(g, num_blocks, ATT_PAGE, ATT_HKV, ATT_D), _bf16(g, num_blocks, ATT_PAGE, ATT_HKV, ATT_D))
              for _ in range(ATT_LAYERS)]
    proj = [_bf16(g, width_qkv, ATT_HQ * ATT_D, scale=(ATT_HQ * ATT_D) ** -0.5) for _ in range(ATT_LAYERS)]
    norms = (_bf16(g, ATT_D, scale=0.1, shift=1.0), _bf16(g, ATT_D, scale=0.1, shift=1.0))
    cos_sin = build_cos_sin_cache(ATT_D, width * ATT_PAGE, 1e6, "cuda")
    tables = torch.randperm(num_blocks, generator=g, device="cuda")[:batch * width].view(batch, width).int()
    lens = torch.empty(batch, dtype=torch.int32, device="cuda")
    positions = torch.empty(batch, dtype=torch.int64, device="cuda")
    slots = torch.empty(batch, dtype=torch.int64, device="cuda")
    qkv0 = _bf16(g, batch, width_qkv)

    def chain(pdl=True):
        qkv = qkv0
        for (kc, vc), w in zip(caches, proj):
            q = qk_norm_rope_store(qkv, positions, cos_sin, kc, vc, slots, ATT_HQ, ATT_HKV, *norms, 1e-6,
                                   pdl=pdl)
            o = paged_decode_attention(q, kc, vc, tables, lens, ATT_D ** -0.5, num_splits=num_splits,
                                       pdl=pdl)
            qkv = skinny_linear(o.view(batch, -1), w, pdl=pdl)
        return qkv

    def set_step(ctx: torch.Tensor):  # the host's inputs for a step, garbage in the newest slots
        lens.copy_(ctx)
        positions.copy_(ctx - 1)
        rows = torch.arange(batch, device="cuda")
        slot = tables[rows, (ctx - 1) // ATT_PAGE].long() * ATT_PAGE + (ctx - 1) % ATT_PAGE
        slots.copy_(slot)
        for kc, vc in caches:
            kc.view(-1, ATT_HKV, ATT_D)[slot] = _bf16(g, batch, ATT_HKV, ATT_D, scale=50.0)
            vc.view(-1, ATT_HKV, ATT_D)[slot] = _bf16(g, batch, ATT_HKV, ATT_D, scale=50.0)

    set_step(torch.randint(1, width * ATT_PAGE, (batch,), generator=g, device="cuda").int())
    chain()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain()
    for step in range(4):  # contexts that start a block, end one, and fall inside one
        ctx = torch.randint(1, width * ATT_PAGE, (batch,), generator=g, device="cuda").int()
        ctx[0] = (1, ATT_PAGE, ATT_PAGE + 1, 3 * ATT_PAGE - 5)[step]
        set_step(ctx)
        graph.replay()
        got = out.clone()
        set_step(ctx)
        want = chain(pdl=False)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
