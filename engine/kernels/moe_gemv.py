"""MoE experts for decode-sized batches: two GEMV kernels that read only the active experts.

At a few tokens the expert GEMMs are a weight stream (batch 1 of Qwen3-30B-A3B reads 8 experts x
9.4 MB per layer), so the grouped path's alignment pass and 16-row tensor-core tiles are pure
overhead. Here:

  1. w13 + SiLU-and-mul: one program per ((token, k) pair, BLOCK_N columns of I), ordered
     pair-fastest so pairs sharing an expert read its rows at about the same time (L2 hits).
  2. w2 x routing weight, summed over k: one program per (token, BLOCK_N columns of H) that
     accumulates the token's k experts in fp32 in a fixed order: deterministic, no third launch.

Both are CUDA-core FMAs on [BLOCK_N, 1, BLOCK_K] tiles sharing the accumulator's layout (as
skinny_gemm.py's FMA path); H and I are constexprs, so the K loops unroll. Graph-safe (no host
sync, no moe_align). Under PDL they wait before their first load: everything they read but the
weights depends on the kernel before (and which weights, on the routing). Torch references:
fused_moe.py's w13_silu_ref, w2_weighted_ref and fused_moe_ref.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.fused_moe import check_shapes
from engine.kernels.moe_configs import KernelTile, MoEGemvConfig, default_gemv
from engine.kernels.pdl import use_pdl, wait_prior


@triton.jit
def _gemv_w13_silu_kernel(
    x_ptr,      # [M, H]
    w13_ptr,    # [E, 2I, H]: gate rows, then up rows
    ids_ptr,    # [M * TOP_K] expert of each (token, k) pair
    inter_ptr,  # [M * TOP_K, I] out
    num_pairs, stride_xm, stride_we, stride_wn, stride_im,
    H: tl.constexpr, I: tl.constexpr, TOP_K: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    # the expert ids are the router's output (the kernel just before): nothing to fetch ahead
    wait_prior(USE_PDL)
    pid = tl.program_id(0)
    pair = pid % num_pairs
    pid_n = pid // num_pairs
    token = pair // TOP_K
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_n, I - 1)  # past-the-end rows re-read the last one: loads stay unmasked
    offs_k = tl.arange(0, BLOCK_K)
    g_ptrs = w13_ptr + expert * stride_we + rows[:, None, None] * stride_wn + offs_k[None, None, :]  # [BN, 1, BK]
    u_ptrs = g_ptrs + I * stride_wn
    x_ptrs = x_ptr + token * stride_xm + offs_k[None, None, :]  # [1, 1, BK]
    acc_g = tl.zeros([BLOCK_N, 1, BLOCK_K], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N, 1, BLOCK_K], dtype=tl.float32)
    for k0 in tl.static_range(0, H, BLOCK_K):
        if k0 + BLOCK_K <= H:
            xk = tl.load(x_ptrs + k0).to(tl.float32)
            g = tl.load(g_ptrs + k0)
            u = tl.load(u_ptrs + k0)
        else:  # ragged last chunk
            k_ok = (k0 + offs_k < H)[None, None, :]
            xk = tl.load(x_ptrs + k0, mask=k_ok, other=0.0).to(tl.float32)
            g = tl.load(g_ptrs + k0, mask=k_ok, other=0.0)
            u = tl.load(u_ptrs + k0, mask=k_ok, other=0.0)
        acc_g += g.to(tl.float32) * xk
        acc_u += u.to(tl.float32) * xk
    gate = tl.sum(acc_g, axis=2)  # [BN, 1]
    up = tl.sum(acc_u, axis=2)
    # silu in fp32, rounded once to the activation dtype (as the grouped path)
    h = gate / (1.0 + tl.exp(-gate)) * up
    out_ptrs = inter_ptr + pair * stride_im + offs_n[:, None]
    tl.store(out_ptrs, h.to(inter_ptr.dtype.element_ty), mask=(offs_n < I)[:, None])


@triton.jit
def _gemv_w2_sum_kernel(
    inter_ptr,  # [M * TOP_K, I]
    w2_ptr,     # [E, H, I]
    ids_ptr,    # [M * TOP_K]
    topk_w_ptr,  # [M * TOP_K] routing weights, any float dtype
    out_ptr,    # [M, H] out
    num_tokens, stride_im, stride_we, stride_wn, stride_om,
    H: tl.constexpr, I: tl.constexpr, TOP_K: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    wait_prior(USE_PDL)
    pid = tl.program_id(0)
    token = pid % num_tokens
    pid_n = pid // num_tokens
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_n, H - 1)
    offs_k = tl.arange(0, BLOCK_K)
    w_rows = w2_ptr + rows[:, None, None] * stride_wn + offs_k[None, None, :]  # [BN, 1, BK]
    acc = tl.zeros([BLOCK_N, 1, BLOCK_K], dtype=tl.float32)
    for j in tl.static_range(TOP_K):  # a fixed order: the same bits on every run
        pair = token * TOP_K + j
        expert = tl.load(ids_ptr + pair).to(tl.int64)
        # HF casts the routing weight to the hidden dtype before it scales the expert's output
        weight = tl.load(topk_w_ptr + pair).to(out_ptr.dtype.element_ty).to(tl.float32)
        w_ptrs = w_rows + expert * stride_we
        a_ptrs = inter_ptr + pair * stride_im + offs_k[None, None, :]  # [1, 1, BK]
        for k0 in tl.static_range(0, I, BLOCK_K):
            if k0 + BLOCK_K <= I:
                a = tl.load(a_ptrs + k0)
                w = tl.load(w_ptrs + k0)
            else:
                k_ok = (k0 + offs_k < I)[None, None, :]
                a = tl.load(a_ptrs + k0, mask=k_ok, other=0.0)
                w = tl.load(w_ptrs + k0, mask=k_ok, other=0.0)
            acc += w.to(tl.float32) * (a.to(tl.float32) * weight)
    res = tl.sum(acc, axis=2)  # [BN, 1]
    out_ptrs = out_ptr + token * stride_om + offs_n[:, None]
    tl.store(out_ptrs, res.to(out_ptr.dtype.element_ty), mask=(offs_n < H)[:, None])


def _block(block: int, dim: int) -> int:
    """Tiles past the dimension only add masked work: cap at the next power of two."""
    return min(block, triton.next_power_of_2(dim))


def gemv_w13_silu(x: torch.Tensor, w13: torch.Tensor, topk_ids: torch.Tensor, tile: KernelTile,
                  inter: torch.Tensor | None = None, pdl: bool = True) -> torch.Tensor:
    """inter [M*k, I] (x.dtype) = silu(x_t G_e^T) * (x_t U_e^T) for every pair (t, j), e = topk_ids[t, j].
    x [M, H] and w13 [E, 2I, H] contiguous; topk_ids [M, k] int."""
    num_tokens, hidden = x.shape
    inter_size = w13.shape[1] // 2
    ids = topk_ids.reshape(-1)
    num_pairs = ids.numel()
    if inter is None:
        inter = torch.empty(num_pairs, inter_size, dtype=x.dtype, device=x.device)
    if num_pairs == 0:
        return inter
    bn, bk = _block(tile.block_n, inter_size), _block(tile.block_k, hidden)
    pdl = use_pdl(x, pdl)
    _gemv_w13_silu_kernel[(num_pairs * triton.cdiv(inter_size, bn),)](
        x, w13, ids, inter, num_pairs, x.stride(0), w13.stride(0), w13.stride(1), inter.stride(0),
        H=hidden, I=inter_size, TOP_K=topk_ids.shape[1], BLOCK_N=bn, BLOCK_K=bk, USE_PDL=pdl,
        num_warps=tile.num_warps, num_stages=tile.num_stages, launch_pdl=pdl,
    )
    return inter


def gemv_w2_sum(inter: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor, tile: KernelTile, out: torch.Tensor,
                pdl: bool = True) -> torch.Tensor:
    """out [M, H] = sum_j weight[t, j] * inter[(t, j)] W2_e^T, summed in the order j = 0..k-1.
    inter [M*k, I] and w2 [E, H, I] contiguous; topk_weights, topk_ids [M, k]."""
    num_tokens, top_k = topk_ids.shape
    hidden, inter_size = w2.shape[1], w2.shape[2]
    if num_tokens == 0:
        return out
    bn, bk = _block(tile.block_n, hidden), _block(tile.block_k, inter_size)
    pdl = use_pdl(inter, pdl)
    _gemv_w2_sum_kernel[(num_tokens * triton.cdiv(hidden, bn),)](
        inter, w2, topk_ids.reshape(-1), topk_weights.reshape(-1), out,
        num_tokens, inter.stride(0), w2.stride(0), w2.stride(1), out.stride(0),
        H=hidden, I=inter_size, TOP_K=top_k, BLOCK_N=bn, BLOCK_K=bk, USE_PDL=pdl,
        num_warps=tile.num_warps, num_stages=tile.num_stages, launch_pdl=pdl,
    )
    return out


def fused_moe_gemv(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                   topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                   out: torch.Tensor | None = None, config: MoEGemvConfig | None = None,
                   pdl: bool = True) -> torch.Tensor:
    """Same contract as fused_moe.fused_moe (x [M, H], w13 [E, 2I, H], w2 [E, H, I], topk_* [M, k];
    fp32 routing weights are rounded to x.dtype in the kernel), in two launches (with PDL where
    `pdl` and the GPU allow: KernelConfig.pdl)."""
    check_shapes(x, w13, w2, topk_weights, topk_ids)
    if out is None:
        out = torch.empty_like(x)
    if x.shape[0] == 0:
        return out
    cfg = config or default_gemv(x.element_size())
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    topk_ids, topk_weights = topk_ids.contiguous(), topk_weights.contiguous()
    inter = gemv_w13_silu(x, w13, topk_ids, cfg.w13, pdl=pdl)
    return gemv_w2_sum(inter, w2, topk_weights, topk_ids, cfg.w2, out, pdl=pdl)
