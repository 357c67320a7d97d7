"""Skinny GEMM for decode at small batch: out[M, N] = x[M, K] @ W[N, K]^T (+ bias), M <= 16.

At M <= 8 a linear layer is a weight stream, where cuBLAS's tilings (made for large M) reach a
fraction of the copy bandwidth. Each program here takes BLOCK_N rows of W (and, with
SPLIT_K > 1, one slice of K) and sweeps K in BLOCK_K chunks with unmasked 16-byte loads.

Two inner products, chosen per config:
  * FMA (use_dot=False): broadcast-multiply on CUDA cores into one fp32 accumulator
    [BLOCK_N, BLOCK_M, BLOCK_K], reduced over K once after the loop. Best at M = 1..2.
  * DOT (use_dot=True): tensor cores with A and B swapped (out^T = W @ x^T), so the weight tile
    is the MMA's M side (BLOCK_N >= 16) and x, padded to 16 rows, its N side; Triton pipelines
    the W tiles through shared memory. Best at M >= 4.

Split-K writes fp32 partials to a [SPLIT_K, M, N] workspace that a second kernel sums in a
fixed order (deterministic, unlike atomics). Both launches are CUDA-graph safe.

Under PDL (pdl.py) each program requests its first chunk of W before waiting for the kernel
that writes x. X_MODE folds an RMSNorm of x (+ the residual) in (skinny_prologue.py,
`rms_norm_linear`); GATED reads a merged gate_up weight [2N, K] and stores silu(gate) * up.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .pdl import use_pdl, wait_prior
from .skinny_prologue import (X_PLAIN, X_RMSNORM, X_RMSNORM_FACTORED, load_chunk, row_rstd,
                              x_chunk)

# Wider one-row programs (pick_config's `wide`) for the fused-norm GEMV without the SwiGLU
# epilogue only (the decoder's QKV projection at batch 1): one H200, Qwen3-0.6B, -35.6 us of a
# 723 us step; slower or even for the other GEMVs (bench/RESULTS.md, 2026-12-03 third session).
# Only up to this K: at Qwen3-30B-A3B's QKV (K = 2,048) the narrow programs were faster.
WIDE_MAX_K = 1024
MAX_M = 16  # the DOT path pads x to 16 rows; beyond that an ordinary GEMM tiling is the right tool
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class SkinnyConfig:
    block_n: int  # rows of W (output columns) per program
    block_k: int  # K elements per loop iteration
    split_k: int = 1  # K slices, each its own program; > 1 adds the reduce kernel
    num_warps: int = 4
    num_stages: int = 3  # software-pipelined loads in flight per program
    use_dot: bool = False  # tensor-core (swap-AB) inner product instead of CUDA-core FMAs

    def short(self) -> str:
        return (f"{'dot' if self.use_dot else 'fma'} n{self.block_n} k{self.block_k} s{self.split_k} "
                f"w{self.num_warps} st{self.num_stages}")


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int | None) -> int:
    if device_index is None or not torch.cuda.is_available():
        return 132  # H200 / H100 SXM; only shapes the CPU (interpreter) path, where speed is moot
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def fma_acc_regs(cfg: SkinnyConfig, M: int) -> int:
    """fp32 accumulator registers per thread on the FMA path (BLOCK_N x BLOCK_M x BLOCK_K over the
    threads); past ~128 the kernel spills."""
    if cfg.use_dot:
        return 0
    return cfg.block_n * triton.next_power_of_2(M) * cfg.block_k // (32 * cfg.num_warps)


def pick_config(M: int, N: int, K: int, elem_size: int = 2, num_sms: int = 132,
                wide: bool = False) -> SkinnyConfig:
    """Heuristic for an H200 (132 SMs, ~4.1 TB/s copy), read off
    `bench/diagnostics/skinny_gemm.py --wide` at the Qwen3 decode shapes for M = 1, 2, 4, 8.

    A weight stream needs ~4 MB in flight chip-wide (Little's law). The FMA path gets there with
    many small programs, but its accumulator shrinks what a program keeps in flight as 1/M, so
    past M = 2..4 it falls behind the tensor-core path's cp.async pipeline. `wide` (M = 1,
    K <= WIDE_MAX_K): 4-warp programs of 4-8 rows, a half to a quarter as many.
    """
    bm = triton.next_power_of_2(M)
    scale = max(1, elem_size // 2)  # sizes below are for 2-byte types; fp32 halves BLOCK_K (same bytes)
    fma = bm == 1 or (bm == 2 and N <= 5120) or (bm == 4 and N <= 1024)
    if fma:
        if bm == 1 and wide and K <= WIDE_MAX_K:
            # fewer, wider programs: 128 threads and 4-8 rows each
            block_n, block_k, warps = (8, 1024, 4) if N >= 4096 else (4, 1024, 4)
        elif N >= 4096 and bm <= 2:
            # enough rows for ~8 programs per SM even at 4 rows each: narrow 2-warp programs,
            # one 16-byte vector per thread per row per iteration
            block_n, block_k, warps = 4, 512, 2
        elif bm <= 2:
            # few rows (o_proj, down_proj): 2 rows a program keeps >= 512 programs in the grid
            block_n, block_k, warps = 2, 1024, 4
        else:
            # M = 3..4: two vectors per thread per row to keep loads in flight (128 acc registers)
            block_n, block_k, warps = 2, 1024, 2
        block_k //= scale
        vec = 16 // elem_size
        while block_k // 2 >= K and block_k > vec * 32:  # short K: shrink the chunk, then the warps
            block_k //= 2
            warps = max(1, min(warps, block_k // (vec * 32)))  # keep every warp along K
        # tiny N (not Qwen shapes): split K while the grid is under 2 programs per SM and every
        # slice keeps >= 2 chunks
        k_chunks, split = triton.cdiv(K, block_k), 1
        while triton.cdiv(N, block_n) * split < 2 * num_sms and k_chunks >= 4 * split:
            split *= 2
        return SkinnyConfig(block_n, block_k, split, warps, 3, False)
    if triton.cdiv(N, 64) >= 8 * num_sms:  # vocab-sized N: many programs, smaller stages
        cfg = SkinnyConfig(128, 128 // scale, 1, 4, 3, True)
    elif N >= 4096:  # ~1 program per SM (160 KB of stages) but each keeps ~96 KB in flight
        cfg = SkinnyConfig(64, 256 // scale, 1, 4, 4, True)
    else:  # small N: split K so 1024-2048 rows still make 64-128 such programs
        cfg = SkinnyConfig(64, 256 // scale, 4, 4, 3, True)
    block_k = min(cfg.block_k, max(16, triton.next_power_of_2(K)))
    split = min(cfg.split_k, max(1, triton.cdiv(K, block_k) // 2))  # >= 2 chunks per slice
    return SkinnyConfig(cfg.block_n, block_k, split, cfg.num_warps, cfg.num_stages, True)


# The GEMV after decode attention (o_proj) requests its whole weight tile before the PDL wait:
# attention's tail hides it. One H200, Qwen3-0.6B batch-1 decode: -14 us a step; the other
# GEMVs were slower or even (bench/RESULTS.md, 2026-12-03). Only up to this K: at
# Qwen3-30B-A3B's o_proj (K = 4,096) the pipelined plain config was faster.
WHOLE_TILE_MAX_K = 2048


def whole_tile_config(N: int, K: int, elem_size: int = 2) -> SkinnyConfig | None:
    """pick_config(1, N, K) with one chunk of all of K (a power of two, the tail masked), so a
    program's whole weight tile is requested before the PDL wait; None where that does not
    apply (K past WHOLE_TILE_MAX_K, or a config that is not the one-row FMA path)."""
    c = pick_config(1, N, K, elem_size)
    if c.use_dot or c.split_k != 1 or K > WHOLE_TILE_MAX_K or K == 0:
        return None
    return SkinnyConfig(c.block_n, triton.next_power_of_2(K), 1, c.num_warps, 1, False)


@triton.jit
def _accumulate(acc, w, x, USE_DOT: tl.constexpr, IEEE_DOT: tl.constexpr):
    if USE_DOT:
        if IEEE_DOT:  # fp32 weights: exact fp32 products, not tf32
            acc = tl.dot(w, tl.trans(x), acc, input_precision="ieee")
        else:
            acc = tl.dot(w, tl.trans(x), acc)
    else:
        acc += w.to(tl.float32) * x.to(tl.float32)
    return acc


@triton.jit
def _skinny_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, ws_ptr, res_ptr, norm_w_ptr, res_out_ptr, sumsq_ptr,
    M, N, K, k_per_split, stride_xm, stride_wn, stride_om, stride_rm, stride_rom, eps,
    HAS_BIAS: tl.constexpr, IS_SPLIT: tl.constexpr, USE_DOT: tl.constexpr, IEEE_DOT: tl.constexpr,
    EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
    X_MODE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, WRITE_SUMSQ: tl.constexpr,
    GATED: tl.constexpr = False,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    # Out-of-range rows of W and x are clamped to the last real row rather than masked, so the
    # loads stay unmasked (vectorised); their results land in outputs that are never stored.
    rows_n = tl.minimum(offs_n, N - 1).to(tl.int64)  # int64: N * stride_wn can pass 2^31 (lm_head)
    rows_m = tl.minimum(offs_m, M - 1)
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(K, k_lo + k_per_split)
    if USE_DOT:  # 2-D tiles: W [BLOCK_N, BLOCK_K], x [BLOCK_M, BLOCK_K]
        w_ptrs = w_ptr + rows_n[:, None] * stride_wn + (k_lo + offs_k)[None, :]
        x_rows = rows_m[:, None] * stride_xm
        r_rows = rows_m[:, None] * stride_rm
        ro_rows = rows_m[:, None] * stride_rom
        m_ok = (offs_m < M)[:, None]
        kk = k_lo + offs_k[None, :]
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        if GATED:
            acc_up = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        # 3-D tiles, W [BLOCK_N, 1, BLOCK_K] and x [1, BLOCK_M, BLOCK_K], loaded in that shape so
        # both share the accumulator's layout (a 2-D load expanded afterwards gets re-laid out
        # through shared memory every iteration); one reduction over K after the loop.
        w_ptrs = w_ptr + rows_n[:, None, None] * stride_wn + (k_lo + offs_k)[None, None, :]
        x_rows = rows_m[None, :, None] * stride_xm
        r_rows = rows_m[None, :, None] * stride_rm
        ro_rows = rows_m[None, :, None] * stride_rom
        m_ok = (offs_m < M)[None, :, None]
        kk = k_lo + offs_k[None, None, :]
        acc = tl.zeros([BLOCK_N, BLOCK_M, BLOCK_K], dtype=tl.float32)
        if GATED:
            acc_up = tl.zeros([BLOCK_N, BLOCK_M, BLOCK_K], dtype=tl.float32)
    # GATED (a merged gate_up weight, [2N, K]): each program also streams the N-th row after each
    # of its rows (the up projection's) and the epilogue stores silu(gate) * up.
    up_off = N * stride_wn
    # The first chunk is peeled off the loop so that, under PDL, its weights are requested
    # before the wait for the kernel that writes x (one H200, batch-1 decode 1,167 -> 1,203
    # tok/s). Every program has >= 1 chunk: the host never launches an empty K slice.
    k_ok = kk < k_hi  # (unused when EVEN_K)
    w = load_chunk(w_ptrs, k_ok, EVEN_K)
    if GATED:
        w_up = load_chunk(w_ptrs + up_off, k_ok, EVEN_K)
    wait_prior(USE_PDL)
    rstd = 1.0
    if X_MODE == 1:  # RMSNorm needs the whole row's sum of squares first
        rstd_m, sq = row_rstd(x_ptr, res_ptr, rows_m, stride_xm, stride_rm, K, eps,
                              HAS_RESIDUAL, BLOCK_M, BLOCK_K)
        if WRITE_SUMSQ:  # probes: ||residual||^2 per row, from the sum the norm needs anyway
            if (pid_n == 0) & (pid_k == 0):
                tl.store(sumsq_ptr + offs_m, sq, mask=offs_m < M)
        rstd = rstd_m[:, None] if USE_DOT else rstd_m[None, :, None]
    first_col = pid_n == 0
    x, s = x_chunk(x_ptr, x_rows, kk, k_ok, K, res_ptr, r_rows, res_out_ptr, ro_rows,
                   m_ok & k_ok, first_col, norm_w_ptr, rstd, X_MODE, HAS_RESIDUAL, EVEN_K)
    acc = _accumulate(acc, w, x, USE_DOT, IEEE_DOT)
    if GATED:
        acc_up = _accumulate(acc_up, w_up, x, USE_DOT, IEEE_DOT)
    if X_MODE == 3:  # the sum of squares, element by element until after the loop
        sq_acc = s.to(tl.float32) * s.to(tl.float32)
    for k0 in range(k_lo + BLOCK_K, k_hi, BLOCK_K):
        w_ptrs += BLOCK_K
        kk += BLOCK_K
        k_ok = kk < k_hi
        w = load_chunk(w_ptrs, k_ok, EVEN_K)
        if GATED:
            w_up = load_chunk(w_ptrs + up_off, k_ok, EVEN_K)
        x, s = x_chunk(x_ptr, x_rows, kk, k_ok, K, res_ptr, r_rows, res_out_ptr, ro_rows,
                       m_ok & k_ok, first_col, norm_w_ptr, rstd, X_MODE, HAS_RESIDUAL, EVEN_K)
        acc = _accumulate(acc, w, x, USE_DOT, IEEE_DOT)
        if GATED:
            acc_up = _accumulate(acc_up, w_up, x, USE_DOT, IEEE_DOT)
        if X_MODE == 3:
            sq_acc += s.to(tl.float32) * s.to(tl.float32)
    if USE_DOT:
        res = acc  # [BLOCK_N, BLOCK_M]: out transposed
        if GATED:
            res_up = acc_up
    else:
        res = tl.sum(acc, axis=2)
        if GATED:
            res_up = tl.sum(acc_up, axis=2)
    if X_MODE == 3:
        if USE_DOT:
            sq = tl.sum(sq_acc, axis=1)  # [BLOCK_M]
        else:
            sq = tl.sum(tl.sum(sq_acc, axis=2), axis=0)
        rstd_f = tl.rsqrt(sq / K + eps)[None, :]
        res = res * rstd_f
        if GATED:
            res_up = res_up * rstd_f
        if WRITE_SUMSQ:
            if pid_n == 0:
                tl.store(sumsq_ptr + offs_m, sq, mask=offs_m < M)

    if GATED:  # the unfused path's rounding points: gate and up, silu(gate), the product
        dt = out_ptr.dtype.element_ty
        gate = res.to(dt).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32)
        res = act * res_up.to(dt).to(tl.float32)
    store_mask = (offs_n < N)[:, None] & (offs_m < M)[None, :]
    if IS_SPLIT:
        part_ptrs = ws_ptr + (pid_k * M + offs_m[None, :]).to(tl.int64) * N + offs_n[:, None]
        tl.store(part_ptrs, res, mask=store_mask)
    else:
        if HAS_BIAS:
            res += tl.load(b_ptr + rows_n).to(tl.float32)[:, None]
        out_ptrs = out_ptr + offs_m[None, :] * stride_om + offs_n[:, None]
        tl.store(out_ptrs, res.to(out_ptr.dtype.element_ty), mask=store_mask)


@triton.jit
def _splitk_reduce_kernel(ws_ptr, b_ptr, out_ptr, M, N, stride_om,
                          HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr,
                          USE_PDL: tl.constexpr):
    wait_prior(USE_PDL)
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    total = M * N
    mask = idx < total
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):  # fixed order: the same bits on every run
        acc += tl.load(ws_ptr + s * total + idx, mask=mask, other=0.0)
    n = idx % N
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + (idx // N) * stride_om + n, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _check_config(cfg: SkinnyConfig) -> None:
    for name in ("block_n", "block_k"):
        v = getattr(cfg, name)
        if v < 1 or v & (v - 1):
            raise ValueError(f"{name} must be a power of two, got {v}")
    if cfg.split_k < 1 or cfg.num_warps < 1 or cfg.num_stages < 1:
        raise ValueError(f"bad config {cfg}")
    if cfg.use_dot and (cfg.block_n < 16 or cfg.block_k < 16):
        raise ValueError(f"use_dot needs block_n >= 16 and block_k >= 16 (tl.dot), got {cfg}")


def _check_operands(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, k_x: int) -> None:
    if weight.dim() != 2 or x.shape[-1] != k_x:
        raise ValueError(f"shapes do not match: x {tuple(x.shape)}, weight {tuple(weight.shape)}")
    if weight.stride(1) != 1:
        raise ValueError(f"weight must have unit stride along K (row-major [N, K]); strides {weight.stride()}")
    if x.dtype not in _DTYPES or weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        raise ValueError(f"x, weight and bias must share one of {_DTYPES}; got {x.dtype}, {weight.dtype}, "
                         f"{None if bias is None else bias.dtype}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias must be [{weight.shape[0]}], got {tuple(bias.shape)}")
    if x.shape[:-1].numel() > MAX_M:
        raise ValueError(f"skinny_linear is for M <= {MAX_M} rows, got {x.shape[:-1].numel()}: use F.linear")


def _rows(t: torch.Tensor, width: int) -> torch.Tensor:
    """t as [M, width] with a unit last stride (a copy only when it has none)."""
    t2 = t.reshape(t.shape[:-1].numel(), width)  # not -1: width may be 0
    return t2 if t2.stride(1) == 1 else t2.contiguous()


def gated_config(cfg: SkinnyConfig) -> SkinnyConfig:
    """A config picked for the merged [2N, K] weight, for the gated kernel: half the rows of each
    half a program (the same weight bytes a program), and no split-K (the epilogue needs the
    whole sum)."""
    return SkinnyConfig(max(16 if cfg.use_dot else 1, cfg.block_n // 2), cfg.block_k, 1,
                        cfg.num_warps, cfg.num_stages, cfg.use_dot)


def _launch(x2, weight, bias, config, mode=X_PLAIN, residual=None, norm_weight=None, eps=0.0,
            residual_out=None, sumsq=None, gated=False, wide=False, pdl=True) -> torch.Tensor:
    """out [M, N] = prologue(x2) @ weight^T (+ bias); x2 is [M, K]. gated: weight is [2N, K]
    and out = silu(prologue(x2) @ weight[:N]^T) * (prologue(x2) @ weight[N:]^T)."""
    N, K = weight.shape
    M = x2.shape[0]
    if gated:
        if bias is not None or N % 2:
            raise ValueError(f"the gated GEMV takes a bias-free [2N, K] weight; got {tuple(weight.shape)}"
                             f"{' with a bias' if bias is not None else ''}")
        N //= 2
    out = torch.empty((M, N), dtype=x2.dtype, device=x2.device)
    if M == 0 or N == 0 or K == 0:
        return _empty_k(out, bias)  # K == 0: empty sums, the bias alone (silu(0) * 0 when gated)
    if bias is not None and bias.stride(0) != 1:
        bias = bias.contiguous()
    cfg = config or pick_config(M, 2 * N if gated else N, K, x2.element_size(),
                                _num_sms(x2.device.index if x2.is_cuda else None), wide)
    _check_config(cfg)
    if gated and config is None:
        cfg = gated_config(cfg)
    elif gated and cfg.split_k > 1:
        raise ValueError(f"the gated GEMV cannot split K (its epilogue needs the whole sum): {cfg}")

    block_m = 16 if cfg.use_dot else triton.next_power_of_2(M)
    k_per_split = triton.cdiv(triton.cdiv(K, cfg.split_k), cfg.block_k) * cfg.block_k
    split = triton.cdiv(K, k_per_split)  # never launch an empty slice
    if mode == X_RMSNORM_FACTORED and split > 1:
        mode = X_RMSNORM  # a K slice does not see the whole row's sum of squares
    grid = (triton.cdiv(N, cfg.block_n), split)
    ws = torch.empty((split, M, N), dtype=torch.float32, device=x2.device) if split > 1 else out
    b = bias if bias is not None else out  # placeholder pointers, never read
    res = residual if residual is not None else x2
    res_out = residual_out if residual_out is not None else x2
    pdl = use_pdl(x2, pdl)
    _skinny_kernel[grid](
        x2, weight, b, out, ws, res, norm_weight if norm_weight is not None else x2, res_out,
        sumsq if sumsq is not None else ws,
        M, N, K, k_per_split, x2.stride(0), weight.stride(0), out.stride(0), res.stride(0),
        res_out.stride(0), eps,
        HAS_BIAS=bias is not None, IS_SPLIT=split > 1, USE_DOT=cfg.use_dot,
        IEEE_DOT=x2.dtype == torch.float32, EVEN_K=K % cfg.block_k == 0,
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        USE_PDL=pdl,
        X_MODE=mode, HAS_RESIDUAL=residual is not None, WRITE_SUMSQ=sumsq is not None,
        GATED=gated, num_warps=cfg.num_warps, num_stages=cfg.num_stages, launch_pdl=pdl,
    )
    if split > 1:
        block = 256
        _splitk_reduce_kernel[(triton.cdiv(M * N, block),)](
            ws, b, out, M, N, out.stride(0),
            HAS_BIAS=bias is not None, SPLIT_K=split, BLOCK=block, USE_PDL=pdl, num_warps=2,
            launch_pdl=pdl,
        )
    return out


def _empty_k(out: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return out.zero_() if bias is None else out.copy_(bias.expand_as(out))


def skinny_linear(
    x: torch.Tensor,       # [..., K], M = prod(leading dims) <= 16
    weight: torch.Tensor,  # [N, K], unit stride along K (row slices and column slices are fine)
    bias: torch.Tensor | None = None,  # [N]
    config: SkinnyConfig | None = None,  # None: pick_config(M, N, K)
    pdl: bool = True,      # launch with PDL where the GPU has it (KernelConfig.pdl)
) -> torch.Tensor:         # [..., N], x.dtype
    _check_operands(x, weight, bias, weight.shape[1] if weight.dim() == 2 else -1)
    N, K = weight.shape
    out = _launch(_rows(x, K), weight, bias, config, pdl=pdl)
    return out.reshape(*x.shape[:-1], N)


def rms_norm_linear(
    x: torch.Tensor,            # [M, K] (the sublayer's output, or the embedding at layer 0)
    weight: torch.Tensor,       # [N, K]
    norm_weight: torch.Tensor,  # [K]
    eps: float,
    residual: torch.Tensor | None = None,  # [M, K]: added to x first (the fused residual add)
    bias: torch.Tensor | None = None,
    sumsq: torch.Tensor | None = None,     # [>= M] fp32: also store sum((x + residual)^2) per row
    config: SkinnyConfig | None = None,
    factored: bool = False,  # scale the product by 1/rms instead of x (skinny_prologue.py)
    gated: bool = False,     # weight is a merged [2N, K] gate_up: return silu(gate) * up [M, N]
    pdl: bool = True,        # launch with PDL where the GPU has it (KernelConfig.pdl)
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual) @ weight^T + bias, x + residual) in one launch (two with split-K):
    fused_add_rms_norm followed by skinny_linear, without the normed rows ever in memory. With
    `gated`, silu_and_mul of that product too (the dense MLP's gate_up at batch 1; no split-K)."""
    K = weight.shape[1] if weight.dim() == 2 else -1
    _check_operands(x, weight, bias, K)
    if x.dim() != 2 or tuple(norm_weight.shape) != (K,) or norm_weight.dtype != x.dtype:
        raise ValueError(f"rms_norm_linear takes x [M, {K}] and a [{K}] norm weight of x's dtype; got "
                         f"x {tuple(x.shape)}, norm weight {tuple(norm_weight.shape)} {norm_weight.dtype}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"residual must match x: {tuple(residual.shape)} {residual.dtype}")
    x2 = _rows(x, K)
    if sumsq is not None and (sumsq.dtype != torch.float32 or sumsq.stride(0) != 1
                              or sumsq.shape[0] < x2.shape[0]):
        raise ValueError(f"sumsq must be a contiguous fp32 buffer of >= {x2.shape[0]} rows")
    if residual is None:
        residual_out = x
        r2 = None
    else:
        r2 = _rows(residual, K)
        residual_out = torch.empty_like(x2)
    if K == 0 and sumsq is not None:  # empty rows: no kernel runs to store their sums
        sumsq[:x2.shape[0]] = 0.0
    out = _launch(x2, weight, bias, config, X_RMSNORM_FACTORED if factored else X_RMSNORM, r2,
                  norm_weight.contiguous(), eps, residual_out if r2 is not None else None, sumsq,
                  gated, wide=not gated, pdl=pdl)
    return out, residual_out


def skinny_linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Reference: the same product in fp32, rounded once to x.dtype."""
    return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)


def rms_norm_linear_ref(x, weight, norm_weight, eps, residual=None, bias=None, sumsq=None,
                        gated=False):
    """Reference: the unfused torch ops (HF's norm, then the fp32 product, then HF's SwiGLU)."""
    from .activation import silu_and_mul_ref
    from .rmsnorm import fused_add_rms_norm_ref, rms_norm_ref
    if residual is None:
        h, residual_out = rms_norm_ref(x, norm_weight, eps, sumsq), x
    else:
        h, residual_out = fused_add_rms_norm_ref(x, residual, norm_weight, eps, sumsq)
    out = skinny_linear_ref(h, weight, bias)
    return (silu_and_mul_ref(out) if gated else out), residual_out

