"""GPU: skinny_linear in bf16 at the Qwen decode shapes against an fp32 product, and replayed from
a CUDA graph after its input changes in place."""
import pytest
import torch

from engine.kernels import skinny_gemm as sg_module
from engine.kernels.skinny_gemm import (SkinnyConfig, fma_acc_regs, skinny_linear, skinny_linear_ref,
                                        whole_tile_config)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

BF16 = torch.bfloat16
SHAPES = [  # (N, K): Qwen3-0.6B qkv, o_proj, gate_up, down, lm_head; Qwen3-30B-A3B qkv, o_proj
    (4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (151936, 1024), (5120, 2048), (2048, 4096),
]
# One explicit config of each kind, so a heuristic change cannot leave a path untested on the GPU.
CONFIGS = [
    SkinnyConfig(4, 512, 1, 2, 3),             # FMA
    SkinnyConfig(2, 1024, 2, 4, 3),            # FMA, split-K
    SkinnyConfig(32, 256, 1, 4, 3, True),      # tensor cores
    SkinnyConfig(16, 256, 4, 4, 3, True),      # tensor cores, split-K
]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    with torch.device("cuda"):
        yield


def _inputs(M, N, K, bias):
    x = torch.randn(M, K, dtype=BF16)
    w = (torch.randn(N, K) / K**0.5).to(BF16)
    b = torch.randn(N, dtype=BF16) if bias else None
    return x, w, b


def assert_bf16_close(out, x, w, b):
    """The kernel accumulates in fp32 and rounds once, so it sits within about half a bf16 ulp
    (2^-9 relative) of the exact fp32 product; 8e-3 leaves room for summation order."""
    exact = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
    assert out.dtype == BF16 and out.shape == exact.shape
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), exact, rtol=8e-3, atol=1e-3)
    # and it equals the rounded reference but for one-ulp flips at rounding boundaries
    torch.testing.assert_close(out, skinny_linear_ref(x, w, b), rtol=1.6e-2, atol=1e-3)


@pytest.mark.parametrize("M", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("N,K", SHAPES)
def test_heuristic_config_at_qwen_shapes(N, K, M):
    x, w, b = _inputs(M, N, K, bias=M == 3)
    assert_bf16_close(skinny_linear(x, w, b), x, w, b)


@pytest.mark.parametrize("N,K", [(1024, 2048), (2048, 4096), (1024, 1024), (896, 1792)])
def test_whole_tile_config_at_o_proj_shapes(N, K, monkeypatch):
    """o_proj's one-row GEMV with its whole weight tile in one chunk (Qwen3-0.6B, Qwen3-30B-A3B
    with WHOLE_TILE_MAX_K raised, TP 2 of 0.6B, and Qwen2.5-0.5B's 896 x 1792 whose K is not a
    power of two: a masked tail)."""
    monkeypatch.setattr(sg_module, "WHOLE_TILE_MAX_K", 4096)
    cfg = whole_tile_config(N, K)
    assert cfg is not None and cfg.block_k >= K and cfg.split_k == 1
    x, w, _ = _inputs(1, N, K, bias=False)
    assert_bf16_close(skinny_linear(x, w, config=cfg), x, w, None)


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.short().replace(" ", "-"))
@pytest.mark.parametrize("M", [1, 5, 8, 16])
def test_each_kernel_path(cfg, M):
    if fma_acc_regs(cfg, M) > 256:
        pytest.skip("FMA accumulator would spill heavily at this M (never picked)")
    x, w, b = _inputs(M, 1024, 3072, bias=True)
    assert_bf16_close(skinny_linear(x, w, b, config=cfg), x, w, b)


def test_strided_weight_view_and_3d_input():
    full = (torch.randn(3000, 1100) / 1100**0.5).to(BF16)
    w = full[7:2055, 13:1037]  # rows of stride 1100: a column slice, no copy
    x = torch.randn(2, 3, 1024, dtype=BF16)
    out = skinny_linear(x, w)
    assert out.shape == (2, 3, 2048)
    assert_bf16_close(out.reshape(6, -1), x.reshape(6, -1), w, None)


@pytest.mark.parametrize("cfg", [None, CONFIGS[1], CONFIGS[3]], ids=["heuristic", "fma-split", "dot-split"])
def test_cuda_graph_replay_sees_new_inputs(cfg):
    M, N, K = 4, 2048, 4096
    x, w, b = _inputs(M, N, K, bias=True)
    skinny_linear(x, w, b, config=cfg)  # compile outside capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = skinny_linear(x, w, b, config=cfg)
    for _ in range(3):
        x.copy_(torch.randn(M, K, dtype=BF16))
        w.copy_((torch.randn(N, K) / K**0.5).to(BF16))
        g.replay()
        torch.cuda.synchronize()
        assert_bf16_close(out, x, w, b)

