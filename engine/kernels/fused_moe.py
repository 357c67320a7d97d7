"""Fused MoE experts, grouped path: align by expert, grouped GEMM w13 + SiLU-and-mul, grouped GEMM
w2 x routing weight, sum over k. For prefill-sized batches; decode batches take moe_gemv.py."""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from engine.kernels.decode_attention import dot_precision
from engine.kernels.jit_keys import varying
from engine.kernels.moe_align import max_used_blocks, moe_align
from engine.kernels.moe_configs import KernelTile, MoEKernelConfig, default_grouped


pick_config = default_grouped  # the untuned grouped config (tuned tables: moe_configs.py)


@triton.jit
def _block_coords(num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    # Grouped launch order: GROUP_M consecutive blocks sweep the N-tiles together.
    pid = tl.program_id(0)
    per_group = GROUP_M * num_pid_n
    first_m = (pid // per_group) * GROUP_M
    group_size = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_size
    pid_n = (pid % per_group) // group_size
    return pid_m, pid_n


@triton.jit(do_not_specialize=varying(
    "sorted_ptr", "expert_ids_ptr", "ntpp_ptr", "num_pairs", "num_pid_m"))
def _w13_silu_mul_kernel(
    x_ptr,  # [N, H]
    w13_ptr,  # [E, 2I, H]
    inter_ptr,  # [N*k, I] out: silu(x W_gate^T) * (x W_up^T), row = flat (token, k) index
    sorted_ptr, expert_ids_ptr, ntpp_ptr,
    num_pairs, H, I, num_pid_m,
    stride_xm, stride_we, stride_wn, stride_im,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
):
    pid_m, pid_n = _block_coords(num_pid_m, tl.cdiv(I, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(ntpp_ptr):
        return
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    flat = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # sentinel = num_pairs
    row_ok = flat < num_pairs
    token = flat // TOP_K
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < I
    offs_k = tl.arange(0, BLOCK_K)

    a_ptrs = x_ptr + token[:, None] * stride_xm + offs_k[None, :]  # [BM, BK]
    g_ptrs = w13_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]  # [BK, BN]
    u_ptrs = g_ptrs + I * stride_wn
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
            g = tl.load(g_ptrs, mask=n_ok[None, :], other=0.0)
            u = tl.load(u_ptrs, mask=n_ok[None, :], other=0.0)
        else:
            k_ok = offs_k < H - k0
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            g = tl.load(g_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            u = tl.load(u_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc_g = tl.dot(a, g, acc_g, input_precision=PRECISION)
        acc_u = tl.dot(a, u, acc_u, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    # silu in fp32, rounded once to the activation dtype (HF rounds gate, up and the product)
    h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    out_ptrs = inter_ptr + flat[:, None] * stride_im + offs_n[None, :]
    tl.store(out_ptrs, h.to(inter_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=varying(
    "topk_weights_ptr", "sorted_ptr", "expert_ids_ptr", "ntpp_ptr", "num_pairs", "num_pid_m"))
def _w2_weighted_kernel(
    inter_ptr,  # [N*k, I]
    w2_ptr,  # [E, H, I]
    y_ptr,  # [N*k, H] out: routing weight * (inter W2^T)
    topk_weights_ptr,  # [N*k] contiguous, any float dtype
    sorted_ptr, expert_ids_ptr, ntpp_ptr,
    num_pairs, H, I, num_pid_m,
    stride_im, stride_we, stride_wn, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
):
    pid_m, pid_n = _block_coords(num_pid_m, tl.cdiv(H, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(ntpp_ptr):
        return
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    flat = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_ok = flat < num_pairs
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < H
    offs_k = tl.arange(0, BLOCK_K)

    a_ptrs = inter_ptr + flat[:, None] * stride_im + offs_k[None, :]  # [BM, BK]
    b_ptrs = w2_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]  # [BK, BN]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
            b = tl.load(b_ptrs, mask=n_ok[None, :], other=0.0)
        else:
            k_ok = offs_k < I - k0
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    # HF casts the routing weights to the hidden dtype: round here, so the caller needs no cast launch
    w = tl.load(topk_weights_ptr + flat, mask=row_ok, other=0.0).to(y_ptr.dtype.element_ty).to(tl.float32)
    acc = acc * w[:, None]
    out_ptrs = y_ptr + flat[:, None] * stride_ym + offs_n[None, :]
    tl.store(out_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _moe_sum_kernel(y_ptr, out_ptr, H, stride_ym, stride_om, TOP_K: tl.constexpr, BLOCK_H: tl.constexpr):
    # Sum of the k weighted expert outputs of one token, in a fixed order: deterministic, no atomics.
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = offs < H
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(y_ptr + (token * TOP_K + j) * stride_ym + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * stride_om + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _tile(block: int, dim: int) -> int:
    return min(block, max(16, triton.next_power_of_2(dim)))


def check_shapes(x, w13, w2, topk_weights, topk_ids) -> None:
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"expected x [N, H], w13 [E, 2I, H], w2 [E, H, I]; got {tuple(x.shape)}, "
                         f"{tuple(w13.shape)}, {tuple(w2.shape)}")
    n, h = x.shape
    e, two_i, h13 = w13.shape
    if h13 != h or two_i % 2 or tuple(w2.shape) != (e, h, two_i // 2):
        raise ValueError(f"inconsistent MoE shapes: x {tuple(x.shape)}, w13 {tuple(w13.shape)} "
                         f"(want [E, 2I, H]), w2 {tuple(w2.shape)} (want [E, H, I])")
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != n:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} "
                         f"must both be [N={n}, top_k]")
    if w13.dtype != x.dtype or w2.dtype != x.dtype:
        raise ValueError(f"weights ({w13.dtype}, {w2.dtype}) must match activations ({x.dtype})")


def grouped_w13_silu(x: torch.Tensor, w13: torch.Tensor, aligned, num_pairs: int, top_k: int,
                     block_m: int, tile: KernelTile) -> torch.Tensor:
    """inter [N*k, I] = silu(x_t G_e^T) * (x_t U_e^T) per (token, k) pair, over moe_align's runs.
    aligned = moe_align(topk_ids, E, block_m)."""
    sorted_ids, expert_ids, ntpp = aligned
    hidden = x.shape[1]
    num_experts, inter_size = w13.shape[0], w13.shape[1] // 2
    num_pid_m = max_used_blocks(num_pairs, num_experts, block_m)
    inter = torch.empty(num_pairs, inter_size, dtype=x.dtype, device=x.device)  # [N*k, I]
    bn, bk = _tile(tile.block_n, inter_size), _tile(tile.block_k, hidden)
    _w13_silu_mul_kernel[(num_pid_m * triton.cdiv(inter_size, bn),)](
        x, w13, inter, sorted_ids, expert_ids, ntpp,
        num_pairs, hidden, inter_size, num_pid_m,
        x.stride(0), w13.stride(0), w13.stride(1), inter.stride(0),
        TOP_K=top_k, BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=tile.group_m,
        EVEN_K=hidden % bk == 0, PRECISION=dot_precision(x.dtype),
        num_warps=tile.num_warps, num_stages=tile.num_stages,
    )
    return inter


def grouped_w2_weighted(inter: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, aligned,
                        block_m: int, tile: KernelTile) -> torch.Tensor:
    """y [N*k, H] = weight x (inter W2_e^T) per pair, over moe_align's runs."""
    sorted_ids, expert_ids, ntpp = aligned
    num_pairs, inter_size = inter.shape
    num_experts, hidden = w2.shape[0], w2.shape[1]
    num_pid_m = max_used_blocks(num_pairs, num_experts, block_m)
    y = torch.empty(num_pairs, hidden, dtype=inter.dtype, device=inter.device)  # [N*k, H]
    bn, bk = _tile(tile.block_n, hidden), _tile(tile.block_k, inter_size)
    _w2_weighted_kernel[(num_pid_m * triton.cdiv(hidden, bn),)](
        inter, w2, y, topk_weights.reshape(-1).contiguous(), sorted_ids, expert_ids, ntpp,
        num_pairs, hidden, inter_size, num_pid_m,
        inter.stride(0), w2.stride(0), w2.stride(1), y.stride(0),
        BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=tile.group_m,
        EVEN_K=inter_size % bk == 0, PRECISION=dot_precision(inter.dtype),
        num_warps=tile.num_warps, num_stages=tile.num_stages,
    )
    return y


def moe_sum(y: torch.Tensor, out: torch.Tensor, top_k: int) -> torch.Tensor:
    """out [N, H] = sum over k of y [N*k, H], in a fixed order."""
    num_tokens, hidden = out.shape
    block_h = min(1024, triton.next_power_of_2(hidden))
    _moe_sum_kernel[(num_tokens, triton.cdiv(hidden, block_h))](
        y, out, hidden, y.stride(0), out.stride(0), TOP_K=top_k, BLOCK_H=block_h, num_warps=4,
    )
    return out


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, out: torch.Tensor | None = None,
              config: MoEKernelConfig | None = None) -> torch.Tensor:
    """out[t] = sum_j topk_weights[t, j] * W2_e (silu(G_e x_t) * (U_e x_t)), e = topk_ids[t, j].

    x [N, H]; w13 [E, 2I, H] (gate rows then up rows); w2 [E, H, I]; topk_* [N, k]. fp32
    weights (the router's) are rounded to x.dtype in the kernel, as HF casts them. CUDA-graph
    safe: no host sync, only statically sized buffers.
    """
    check_shapes(x, w13, w2, topk_weights, topk_ids)
    num_tokens = x.shape[0]
    num_experts = w13.shape[0]
    top_k = topk_ids.shape[1]
    if out is None:
        out = torch.empty_like(x)
    if num_tokens == 0:
        return out
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    cfg = config or pick_config(num_tokens, top_k, num_experts)
    num_pairs = num_tokens * top_k
    aligned = moe_align(topk_ids, num_experts, cfg.block_m)
    inter = grouped_w13_silu(x, w13, aligned, num_pairs, top_k, cfg.block_m, cfg.w13)
    y = grouped_w2_weighted(inter, w2, topk_weights, aligned, cfg.block_m, cfg.w2)
    return moe_sum(y, out, top_k)


def expert_runs(flat_ids: torch.Tensor, num_experts: int) -> list[tuple[int, torch.Tensor]]:
    """(expert, the flat indices routed to it, ascending) for each expert with any, experts
    ascending: the torch paths' loop over experts. One host sync (the counts)."""
    runs = torch.argsort(flat_ids, stable=True).split(
        torch.bincount(flat_ids, minlength=num_experts).tolist())
    return [(e, run) for e, run in enumerate(runs) if run.numel()]


def fused_moe_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """Torch reference in HF's operation order (Qwen3MoeExperts.forward), so fp32 matches HF:
    experts ascending; within one, pairs ordered (k, token) like HF's torch.where over the
    [k, N] mask; weights cast to x.dtype and accumulated with index_add_ in x.dtype."""
    check_shapes(x, w13, w2, topk_weights, topk_ids)
    num_tokens = x.shape[0]
    num_experts = w13.shape[0]
    out = torch.zeros_like(x)  # [N, H]
    ids_kn = topk_ids.t().reshape(-1).long()  # [k*N], flat index = k_pos * N + token
    weights_kn = topk_weights.t().reshape(-1).to(x.dtype)
    for e, pairs in expert_runs(ids_kn, num_experts):
        tokens = pairs % num_tokens
        gate, up = F.linear(x[tokens], w13[e]).chunk(2, dim=-1)
        h = F.linear(F.silu(gate) * up, w2[e])  # [count, H]
        h = h * weights_kn[pairs, None]
        out.index_add_(0, tokens, h.to(out.dtype))
    return out


def w13_silu_ref(x: torch.Tensor, w13: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """Stage reference, fp32: inter [N*k, I] = silu(x_t G_e^T) * (x_t U_e^T) per flat (token, k) pair."""
    flat = topk_ids.reshape(-1).long()
    top_k = topk_ids.shape[1]
    inter = torch.empty(flat.numel(), w13.shape[1] // 2, dtype=torch.float32, device=x.device)
    for e, pairs in expert_runs(flat, w13.shape[0]):
        gate, up = F.linear(x[pairs // top_k].float(), w13[e].float()).chunk(2, dim=-1)
        inter[pairs] = F.silu(gate) * up
    return inter


def w2_weighted_ref(inter: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor) -> torch.Tensor:
    """Stage reference, fp32: y [N*k, H] = weight (rounded to inter.dtype, as HF) x inter W2_e^T
    per pair."""
    flat = topk_ids.reshape(-1).long()
    weights = topk_weights.reshape(-1).to(inter.dtype).float()
    y = torch.empty(flat.numel(), w2.shape[1], dtype=torch.float32, device=inter.device)
    for e, pairs in expert_runs(flat, w2.shape[0]):
        y[pairs] = F.linear(inter[pairs].float(), w2[e].float()) * weights[pairs, None]
    return y
