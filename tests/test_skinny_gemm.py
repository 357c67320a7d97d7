"""skinny_linear on CPU through Triton's interpreter (compiled where CUDA is present) against
torch.nn.functional.linear: ragged N and K, both inner products, split-K, bias, weight views."""
import pytest
import torch

from engine.kernels.skinny_gemm import (
    MAX_M, SkinnyConfig, fma_acc_regs, pick_config, skinny_linear, skinny_linear_ref,
    whole_tile_config,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"   # the CPU: conftest's interpreter
C = SkinnyConfig
# Small blocks so N = 200 / 64 and K = 96 / 320 leave ragged tiles and partial K chunks, and
# few programs, since the interpreter pays per program.
CONFIGS = {
    "fma": C(32, 64, 1, 2, 1),
    "fma-split3": C(32, 32, 3, 1, 1),
    "dot": C(16, 32, 1, 4, 1, True),
    "dot-split2": C(32, 64, 2, 4, 1, True),
}
TOL = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.float16: dict(rtol=2e-3, atol=2e-3)}


def _inputs(M, N, K, dtype, bias, seed):
    g = torch.Generator().manual_seed(seed)  # fresh values per case
    x = torch.randn(M, K, generator=g)
    w = torch.randn(N, K, generator=g) / K**0.5  # outputs ~ N(0, 1)
    b = torch.randn(N, generator=g) if bias else None
    cast = lambda t: None if t is None else t.to(DEVICE, dtype)  # noqa: E731
    return cast(x), cast(w), cast(b)


def assert_matches(out, x, w, b):
    ref = skinny_linear_ref(x, w, b)
    assert out.dtype == x.dtype and out.shape == ref.shape
    torch.testing.assert_close(out, ref, **TOL[x.dtype])
    # the reference itself against an fp64 product, so a wrong reference fails too
    exact = x.double() @ w.double().T + (0 if b is None else b.double())
    torch.testing.assert_close(ref.double(), exact, **TOL[x.dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("N,K", [(200, 96), (64, 320)])
@pytest.mark.parametrize("M", [1, 3, 8])
def test_matches_reference(M, N, K, name, dtype):
    bias = (M + N + len(name)) % 2 == 1  # alternate with and without bias across the grid
    x, w, b = _inputs(M, N, K, dtype, bias, seed=M * 1000 + N + K)
    assert_matches(skinny_linear(x, w, b, config=CONFIGS[name]), x, w, b)


@pytest.mark.parametrize("M", [1, 8])
def test_heuristic_config(M):
    x, w, b = _inputs(M, 96, 160, torch.float32, True, seed=M)
    assert_matches(skinny_linear(x, w, b), x, w, b)


def test_weight_views_without_copies():
    _, full, _ = _inputs(1, 300, 400, torch.float32, False, seed=7)
    x, _, _ = _inputs(3, 1, 96, torch.float32, False, seed=8)
    rows = full[40:240, :96].contiguous()[10:]  # row slice: storage offset, contiguous
    cols = full[40:240, 13:109]  # column slice: row stride 400, unit stride along K
    assert cols.stride() == (400, 1) and not cols.is_contiguous()
    for w in (rows, cols):
        for cfg in (CONFIGS["fma"], CONFIGS["dot-split2"]):
            assert_matches(skinny_linear(x, w, config=cfg), x, w, None)


def test_leading_dims_and_empty_edges():
    x, w, b = _inputs(6, 40, 48, torch.float32, True, seed=3)
    out = skinny_linear(x.reshape(2, 3, 48), w, b, config=CONFIGS["fma"])
    assert out.shape == (2, 3, 40)
    assert_matches(out.reshape(6, 40), x, w, b)
    assert skinny_linear(x[:0], w, b).shape == (0, 40)
    x0, w0 = x[:, :0], w[:, :0]  # K = 0: the bias alone, like F.linear
    torch.testing.assert_close(skinny_linear(x0, w0, b), torch.nn.functional.linear(x0, w0, b))


def test_split_k_is_deterministic():
    x, w, b = _inputs(3, 64, 320, torch.float32, True, seed=11)
    a = skinny_linear(x, w, b, config=CONFIGS["fma-split3"])
    assert torch.equal(a, skinny_linear(x, w, b, config=CONFIGS["fma-split3"]))


def test_rejects_what_it_cannot_do():
    x, w, b = _inputs(2, 32, 48, torch.float32, True, seed=5)
    with pytest.raises(ValueError, match="unit stride"):
        skinny_linear(x, w.T.contiguous().T)  # [N, K] view of a [K, N] buffer: K is strided
    with pytest.raises(ValueError, match="M <="):
        skinny_linear(x.new_zeros(MAX_M + 1, 48), w)
    with pytest.raises(ValueError, match="share"):
        skinny_linear(x.half(), w)
    with pytest.raises(ValueError, match="bias"):
        skinny_linear(x, w, b[:31])
    with pytest.raises(ValueError, match="shapes"):
        skinny_linear(x[:, :40], w)
    with pytest.raises(ValueError, match="use_dot"):
        skinny_linear(x, w, config=C(8, 64, 1, 4, 1, True))
    with pytest.raises(ValueError, match="power of two"):
        skinny_linear(x, w, config=C(24, 64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("K", [96, 320])
def test_whole_tile_config_reads_all_of_k_in_one_chunk(dtype, K):
    """o_proj's config at batch 1 (gemm.linear's after_attention): one chunk a power of two at
    least K, the tail masked (K = 96, 320 are not powers of two), no split."""
    cfg = whole_tile_config(64, K, torch.empty(0, dtype=dtype).element_size())
    assert cfg.block_k == 1 << (K - 1).bit_length() and cfg.split_k == 1 and not cfg.use_dot
    x, w, _ = _inputs(1, 64, K, dtype, False, seed=K)
    assert_matches(skinny_linear(x, w, config=cfg), x, w, None)
    assert whole_tile_config(64, 8192) is None   # past WHOLE_TILE_MAX_K: the plain config
    assert whole_tile_config(2048, 4096) is None   # Qwen3-30B-A3B's o_proj: the plain config
    assert whole_tile_config(1024, 2048) is not None   # Qwen3-0.6B's


QWEN_SHAPES = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (151936, 1024), (5120, 2048), (2048, 4096)]


@pytest.mark.parametrize("elem_size", [2, 4])
def test_pick_config_is_sane_at_qwen_shapes(elem_size):
    """Pure Python: valid tiles, a grid that covers the 132 SMs (the DOT path's 64-row tiles hold
    ~160 KB of stages, one program per SM, so >= 64 programs), no FMA accumulator that spills."""
    for N, K in QWEN_SHAPES:
        for M in range(1, 9):
            c = pick_config(M, N, K, elem_size, 132)
            assert c.block_n & (c.block_n - 1) == 0 and c.block_k & (c.block_k - 1) == 0
            programs = -(-N // c.block_n) * c.split_k
            assert programs >= (64 if c.use_dot else 2 * 132), (M, N, K, c)
            assert fma_acc_regs(c, M) <= 128, (M, N, K, c)
            assert c.block_k * elem_size <= 2048 and (not c.use_dot or c.block_n >= 16)
            assert -(-K // c.block_k) >= c.split_k, (M, N, K, c)  # no empty K slices
