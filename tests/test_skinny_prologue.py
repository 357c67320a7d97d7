"""The skinny GEMM's fused RMSNorm (engine/kernels/skinny_prologue.py) on the CPU through Triton's
interpreter, against the unfused torch ops: with and without the residual add (the residual
stream and the probes' sum of squares written on the side), both forms (prepass, factored),
over both inner products, split-K and ragged K."""
import pytest
import torch

from engine.kernels.skinny_gemm import rms_norm_linear, rms_norm_linear_ref
from test_skinny_gemm import CONFIGS, DEVICE  # one config of each kernel path, small for the interpreter

TOL = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.float16: dict(rtol=4e-3, atol=4e-3)}


def _t(g, *shape, dtype, scale=1.0, shift=0.0):
    return (torch.randn(*shape, generator=g) * scale + shift).to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("M,K", [(1, 96), (3, 320)])
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("factored", [False, True], ids=["prepass", "factored"])
def test_rms_norm_linear_matches_norm_then_linear(M, K, name, dtype, with_residual, factored):
    g = torch.Generator().manual_seed(M * 7919 + K + len(name) * 31 + with_residual + 2 * factored)
    N = 72
    x = _t(g, M, K, dtype=dtype, scale=3.0)
    res = _t(g, M, K, dtype=dtype, scale=2.0) if with_residual else None
    norm_w = _t(g, K, dtype=dtype, scale=0.3, shift=1.0)
    w = _t(g, N, K, dtype=dtype, scale=K ** -0.5)
    b = _t(g, N, dtype=dtype) if M == 3 else None
    sumsq = torch.full((M + 2,), -1.0, device=DEVICE)
    out, resid = rms_norm_linear(x, w, norm_w, 1e-6, res, b, sumsq, config=CONFIGS[name],
                                 factored=factored)
    want_sumsq = torch.full((M + 2,), -1.0, device=DEVICE)
    want, want_resid = rms_norm_linear_ref(x, w, norm_w, 1e-6, res, b, want_sumsq)
    # factored: the scale rounds at another point (after the product, not before the weight)
    torch.testing.assert_close(out, want, **(TOL[dtype] if not factored or dtype == torch.float32
                                             else dict(rtol=1.5e-2, atol=1.5e-2)))
    # the residual stream is the dtype sum, exactly; the rows past M are left alone
    torch.testing.assert_close(resid, want_resid, rtol=0, atol=0)
    torch.testing.assert_close(sumsq, want_sumsq, rtol=1e-5, atol=1e-3)
    assert (sumsq[M:] == -1.0).all()
    # and the reference against an independent fp64 formula, so a wrong reference fails too
    s = (x.double() + (0 if res is None else res.double()))
    h = s / torch.sqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6) * norm_w.double()
    exact = h @ w.double().T + (0 if b is None else b.double())
    torch.testing.assert_close(want.double(), exact, rtol=3e-2, atol=3e-2)


def test_heuristic_configs_and_strided_inputs():
    """No config given (the engine's call), and x / residual as column slices of wider rows."""
    g = torch.Generator().manual_seed(5)
    K, N = 128, 96
    wide = _t(g, 2, 3 * K, dtype=torch.float32)
    x, res = wide[:, :K], wide[:, K:2 * K]
    assert x.stride(0) == 3 * K
    norm_w = _t(g, K, dtype=torch.float32, shift=1.0)
    w = _t(g, N, K, dtype=torch.float32, scale=K ** -0.5)
    out, resid = rms_norm_linear(x, w, norm_w, 1e-5, res)
    want, want_resid = rms_norm_linear_ref(x, w, norm_w, 1e-5, res)
    torch.testing.assert_close(out, want, **TOL[torch.float32])
    torch.testing.assert_close(resid, want_resid, rtol=0, atol=0)


def test_bad_input_says_what_is_wrong():
    x = torch.randn(1, 64, device=DEVICE)
    w = torch.randn(32, 64, device=DEVICE)
    with pytest.raises(ValueError, match="norm weight"):
        rms_norm_linear(x, w, torch.ones(63, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="residual must match"):
        rms_norm_linear(x, w, torch.ones(64, device=DEVICE), 1e-6, torch.randn(2, 64, device=DEVICE))
    with pytest.raises(ValueError, match="shapes do not match"):
        rms_norm_linear(torch.randn(1, 63, device=DEVICE), w, torch.ones(64, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="M <= 16"):
        rms_norm_linear(torch.randn(17, 64, device=DEVICE), w, torch.ones(64, device=DEVICE), 1e-6)


GATED_CONFIGS = {k: v for k, v in CONFIGS.items() if v.split_k == 1}  # the epilogue needs the whole sum


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("name", list(GATED_CONFIGS) + ["picked"])
@pytest.mark.parametrize("M,K", [(1, 96), (3, 320)])
@pytest.mark.parametrize("factored", [False, True], ids=["prepass", "factored"])
def test_gated_rms_norm_linear_is_silu_and_mul_of_the_product(M, K, name, dtype, factored):
    """gated=True: a merged [2N, K] gate_up weight, and the kernel's epilogue stores
    silu(gate) * up (the dense MLP's activation) instead of the [M, 2N] product."""
    g = torch.Generator().manual_seed(M * 31 + K + len(name) + 5 * factored)
    N = 40  # ragged against every config's block_n
    x = _t(g, M, K, dtype=dtype, scale=3.0)
    res = _t(g, M, K, dtype=dtype, scale=2.0)
    norm_w = _t(g, K, dtype=dtype, scale=0.3, shift=1.0)
    w = _t(g, 2 * N, K, dtype=dtype, scale=2 * K ** -0.5)
    sumsq = torch.full((M,), -1.0, device=DEVICE)
    out, resid = rms_norm_linear(x, w, norm_w, 1e-6, res, sumsq=sumsq, factored=factored, gated=True,
                                 config=GATED_CONFIGS.get(name))
    assert out.shape == (M, N)
    want_sumsq = torch.empty(M, device=DEVICE)
    want, want_resid = rms_norm_linear_ref(x, w, norm_w, 1e-6, res, sumsq=want_sumsq, gated=True)
    torch.testing.assert_close(out, want, **(TOL[dtype] if not factored or dtype == torch.float32
                                             else dict(rtol=1.5e-2, atol=1.5e-2)))
    torch.testing.assert_close(resid, want_resid, rtol=0, atol=0)
    torch.testing.assert_close(sumsq, want_sumsq, rtol=1e-5, atol=1e-3)
    # the reference against fp64 SwiGLU of the fp64 product
    s = x.double() + res.double()
    h = s / torch.sqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6) * norm_w.double()
    gu = h @ w.double().T
    exact = torch.nn.functional.silu(gu[:, :N]) * gu[:, N:]
    torch.testing.assert_close(want.double(), exact, rtol=3e-2, atol=3e-2)


def test_gated_rejects_what_it_cannot_fuse():
    g = torch.Generator().manual_seed(9)
    x, norm_w = _t(g, 1, 64, dtype=torch.float32), _t(g, 64, dtype=torch.float32, shift=1.0)
    with pytest.raises(ValueError, match="bias-free"):
        rms_norm_linear(x, _t(g, 80, 64, dtype=torch.float32), norm_w, 1e-6,
                        bias=_t(g, 80, dtype=torch.float32), gated=True)
    with pytest.raises(ValueError, match="bias-free"):
        rms_norm_linear(x, _t(g, 81, 64, dtype=torch.float32), norm_w, 1e-6, gated=True)
    with pytest.raises(ValueError, match="cannot split K"):
        rms_norm_linear(x, _t(g, 80, 64, dtype=torch.float32), norm_w, 1e-6, gated=True,
                        config=CONFIGS["fma-split3"])
    empty, _ = rms_norm_linear(x[:, :0], _t(g, 80, 0, dtype=torch.float32), norm_w[:0], 1e-6, gated=True)
    assert empty.shape == (1, 40) and (empty == 0).all()


def test_one_row_fused_norm_takes_the_wide_programs_and_matches(monkeypatch):
    """At M = 1 the ungated fused-norm GEMV (the decoder's QKV) picks pick_config's wide
    programs (up to WIDE_MAX_K); against the unfused ops at K that makes the wide chunk shrink
    (K < 1024) and at K with two chunks."""
    from engine.kernels import skinny_gemm as SG
    assert SG.pick_config(1, 4096, 1024, wide=True) == SG.SkinnyConfig(8, 1024, 1, 4, 3)
    assert SG.pick_config(1, 4096, 1024) != SG.pick_config(1, 4096, 1024, wide=True)
    # past WIDE_MAX_K (Qwen3-30B-A3B's QKV, K = 2,048) the narrow programs
    assert SG.pick_config(1, 5120, 2048, wide=True) == SG.pick_config(1, 5120, 2048) \
        == SG.SkinnyConfig(4, 512, 1, 2, 3)
    monkeypatch.setattr(SG, "WIDE_MAX_K", 4096)   # the wide programs over two chunks, below
    for K in (96, 2048):
        g = torch.Generator().manual_seed(K)
        x, res = _t(g, 1, K, dtype=torch.float32, scale=2.0), _t(g, 1, K, dtype=torch.float32)
        norm_w, w = _t(g, K, dtype=torch.float32, shift=1.0), _t(g, 48, K, dtype=torch.float32, scale=K ** -0.5)
        out, resid = rms_norm_linear(x, w, norm_w, 1e-6, res, factored=True)
        want, want_resid = rms_norm_linear_ref(x, w, norm_w, 1e-6, res)
        torch.testing.assert_close(out, want, **TOL[torch.float32])
        torch.testing.assert_close(resid, want_resid, rtol=0, atol=0)
