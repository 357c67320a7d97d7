"""GPU: kernels launched with programmatic dependent launch (engine/kernels/pdl.py) still see
their predecessor's output, eagerly and replayed from a CUDA graph.

A decode layer's chain (fused add + RMSNorm -> skinny GEMM -> SiLU*mul -> skinny GEMM, split-K
included) runs 28 times back to back, each kernel reading what the one before it wrote a
moment earlier; a kernel that read its input before its wait, or stored before it, would read
stale or half-written rows and the result would drift from the same chain with PDL off."""
import pytest
import torch

from engine.kernels import pdl
from engine.kernels.activation import silu_and_mul
from engine.kernels.rmsnorm import fused_add_rms_norm
from engine.kernels.skinny_gemm import SkinnyConfig, skinny_linear

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

H, I, LAYERS = 1024, 3072, 28


def _weights(seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device="cuda") * scale).to(torch.bfloat16)
    return [(rnd(H, scale=0.2) + 1, rnd(2 * I, H, scale=H ** -0.5), rnd(H, I, scale=I ** -0.5))
            for _ in range(LAYERS)]


def _chain(x, residual, weights, split_down):
    down_cfg = SkinnyConfig(2, 512, 3, 4, 3) if split_down else None  # split-K: a reduce launch too
    for norm_w, gate_up, down in weights:
        h, residual = fused_add_rms_norm(x, residual, norm_w, 1e-6)
        x = skinny_linear(silu_and_mul(skinny_linear(h, gate_up)), down, config=down_cfg)
    return x, residual


@pytest.mark.parametrize("split_down", [False, True])
def test_pdl_chain_matches_the_chain_without_pdl(monkeypatch, split_down):
    if not pdl.use_pdl(torch.empty(1, device="cuda")):
        pytest.skip("PDL needs sm_90+ (and GLASSBOX_PDL not 0)")
    weights = _weights(1)
    x0 = torch.randn(1, H, device="cuda").to(torch.bfloat16)
    r0 = torch.randn(1, H, device="cuda").to(torch.bfloat16)
    with_pdl = _chain(x0, r0, weights, split_down)
    monkeypatch.setattr(pdl, "ENABLED", False)
    without = _chain(x0, r0, weights, split_down)
    torch.testing.assert_close(with_pdl[0], without[0], rtol=0, atol=0)
    torch.testing.assert_close(with_pdl[1], without[1], rtol=0, atol=0)


def test_pdl_chain_replays_from_a_cuda_graph_with_new_inputs(monkeypatch):
    weights = _weights(2)
    x = torch.randn(1, H, device="cuda").to(torch.bfloat16)
    r = torch.randn(1, H, device="cuda").to(torch.bfloat16)
    _chain(x, r, weights, True)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, res = _chain(x, r, weights, True)
    monkeypatch.setattr(pdl, "ENABLED", False)
    for seed in range(3):
        g = torch.Generator(device="cuda").manual_seed(100 + seed)
        x.copy_(torch.randn(1, H, generator=g, device="cuda"))
        r.copy_(torch.randn(1, H, generator=g, device="cuda"))
        graph.replay()
        want = _chain(x, r, weights, True)  # eager, PDL off
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


# Qwen3-30B-A3B's expert shapes (scaled down in E so the test stays small): the batch-1 MoE chain
# norm -> fused router (GEMV + top-k in one launch) -> w13+SiLU GEMV -> w2 GEMV, each kernel
# launched with PDL and each reading what the one before wrote.
MOE_H, MOE_I, MOE_E, MOE_K, MOE_LAYERS = 2048, 768, 32, 8, 12


def _moe_weights(seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [(_bf16(g, MOE_H, scale=0.2, shift=1.0), _bf16(g, MOE_E, MOE_H, scale=MOE_H ** -0.5),
             _bf16(g, MOE_E, 2 * MOE_I, MOE_H, scale=MOE_H ** -0.5),
             _bf16(g, MOE_E, MOE_H, MOE_I, scale=MOE_I ** -0.5)) for _ in range(MOE_LAYERS)]


def _moe_chain(x, residual, weights, counts):
    from engine.kernels.moe_gemv import fused_moe_gemv
    from engine.kernels.moe_routing import route_hidden
    for norm_w, gate, w13, w2 in weights:
        h, residual = fused_add_rms_norm(x, residual, norm_w, 1e-6)
        _, topk_w, topk_ids = route_hidden(h, gate, MOE_K, True, counts)
        x = fused_moe_gemv(h, w13, w2, topk_w, topk_ids)
    return x, residual


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_pdl_moe_chain_matches_the_chain_without_pdl(monkeypatch, graph):
    from engine.kernels.moe_routing import route_counts
    if not pdl.use_pdl(torch.empty(1, device="cuda")):
        pytest.skip("PDL needs sm_90+ (and GLASSBOX_PDL not 0)")
    weights, counts = _moe_weights(3), route_counts("cuda")
    g = torch.Generator(device="cuda").manual_seed(7)
    x, r = _bf16(g, 1, MOE_H), _bf16(g, 1, MOE_H)
    got = _moe_chain(x, r, weights, counts)  # also compiles outside any capture
    if graph:
        cuda_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cuda_graph):
            got = _moe_chain(x, r, weights, counts)
    monkeypatch.setattr(pdl, "ENABLED", False)
    for seed in range(3 if graph else 1):
        if graph:  # new inputs each replay: different experts every layer
            x.copy_(_bf16(g, 1, MOE_H))
            r.copy_(_bf16(g, 1, MOE_H))
            cuda_graph.replay()
        want = _moe_chain(x, r, weights, counts)
        torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
        torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)
