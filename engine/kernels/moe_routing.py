"""MoE router: softmax over experts, top-k, optional renormalisation — HF Qwen2/3-MoE routing.

The kernels route one token a program (the fused router: one or two) and find the top-k by k
passes of max-and-mask over the E logits, every reduction inside one warp: at 128 tokens
59.6 -> 8.4 µs a layer against ranking 16 x 128 x 128 pairs in 8 programs (one H200,
bench/RESULTS.md 2026-12-02)."""

import torch
import triton
import triton.language as tl

from .pdl import use_pdl, wait_prior


def route_ref(
    router_logits: torch.Tensor, top_k: int, norm_topk_prob: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """HF's routing, op for op (Qwen3MoeTopKRouter / Qwen2MoeTopKRouter): router_logits [N, E]
    (any float dtype) -> probs [N, E] fp32, topk_weights [N, k] fp32, topk_ids [N, k] int32.
    HF then casts the weights to the logits' dtype; here the caller casts, so in bf16 it decides
    where rounding happens."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)  # [N, E]
    topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)  # [N, k]
    if norm_topk_prob:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return probs, topk_weights, topk_ids.to(torch.int32)


_TAKEN = tl.constexpr(-2147483648)  # int32 min: below the sort key of every float, -inf included


@triton.jit
def _sort_key(z):
    """fp32 -> int32 with the same order (an involution: applied to a key it gives the bits back).
    Non-negative floats keep their bits; negative ones flip their magnitude bits."""
    bits = z.to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _softmax_topk(z, cols, num_experts, BLOCK_T: tl.constexpr, TOP_K: tl.constexpr,
                  K_P2: tl.constexpr, NORM: tl.constexpr):
    """z [BLOCK_T, E_P2] fp32 logits (columns `cols` >= num_experts are pad) -> probs [BLOCK_T, E_P2],
    weights [BLOCK_T, K_P2], ids [BLOCK_T, K_P2] int32 (slots >= TOP_K hold 0).

    Top-k by TOP_K passes of max-and-mask, ties to the lower index: exactly a stable descending
    sort of the logits (probabilities that round equal still told apart). The passes rank an
    int32 key of the logit, so that "struck out" (int32 min) sorts below every logit, even -inf
    (an expert masked by an intervention stays choosable, after every live one, as in torch)."""
    col_ok = (cols < num_experts)[None, :]
    z_max = tl.max(z, axis=1)
    e = tl.where(col_ok, tl.exp(z - z_max[:, None]), 0.0)
    denom = tl.sum(e, axis=1)
    probs = e / denom[:, None]  # [BLOCK_T, E_P2]
    # -0.0 == +0.0 as floats but not as keys: make them one value
    key = tl.where(col_ok, _sort_key(tl.where(z == 0.0, 0.0, z)), _TAKEN)
    slots = tl.arange(0, K_P2)
    weights = tl.zeros([BLOCK_T, K_P2], dtype=tl.float32)
    ids = tl.zeros([BLOCK_T, K_P2], dtype=tl.int32)
    total = tl.zeros([BLOCK_T], dtype=tl.float32)
    for i in tl.static_range(TOP_K):
        best, arg = tl.max(key, axis=1, return_indices=True, return_indices_tie_break_left=True)
        # the winner's probability from its logit by the same ops as `probs`: no gather reduction
        p = tl.exp(_sort_key(best).to(tl.float32, bitcast=True) - z_max) / denom  # [BLOCK_T]
        weights = tl.where(slots[None, :] == i, p[:, None], weights)
        ids = tl.where(slots[None, :] == i, arg[:, None], ids)
        total += p
        key = tl.where(cols[None, :] == arg[:, None], _TAKEN, key)
    if NORM:
        weights = weights / total[:, None]
    return probs, weights, ids


@triton.jit
def _route_rows(
    logits_ptr, stride_l, rows, num_tokens, num_experts, probs_ptr, weights_ptr, ids_ptr,
    TOP_K: tl.constexpr, K_P2: tl.constexpr, E_P2: tl.constexpr, BLOCK_T: tl.constexpr,
    NORM: tl.constexpr, VOLATILE: tl.constexpr,
):
    """Route the BLOCK_T rows `rows` of logits (VOLATILE: written by other programs of this
    launch, so read them from L2, not a stale L1 line)."""
    cols = tl.arange(0, E_P2)
    row_ok = rows < num_tokens
    col_ok = cols < num_experts
    src_rows = tl.minimum(rows, num_tokens - 1)  # tail rows recompute the last token: no NaN from empty rows
    z = tl.load(logits_ptr + src_rows[:, None] * stride_l + cols[None, :], mask=col_ok[None, :],
                other=float("-inf"), volatile=VOLATILE).to(tl.float32)  # [BLOCK_T, E_P2]
    probs, weights, ids = _softmax_topk(z, cols, num_experts, BLOCK_T, TOP_K, K_P2, NORM)
    tl.store(probs_ptr + rows[:, None] * num_experts + cols[None, :], probs,
             mask=row_ok[:, None] & col_ok[None, :])
    slots = tl.arange(0, K_P2)
    out = rows[:, None] * TOP_K + slots[None, :]
    keep = row_ok[:, None] & (slots < TOP_K)[None, :]
    tl.store(weights_ptr + out, weights, mask=keep)
    tl.store(ids_ptr + out, ids, mask=keep)


@triton.jit
def _route_kernel(
    logits_ptr,  # [N, E]
    probs_ptr,  # [N, E] fp32 out
    weights_ptr,  # [N, TOP_K] fp32 out
    ids_ptr,  # [N, TOP_K] int32 out
    num_tokens, num_experts, stride_l,
    TOP_K: tl.constexpr, K_P2: tl.constexpr, E_P2: tl.constexpr, BLOCK_T: tl.constexpr,
    NORM: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    _route_rows(logits_ptr, stride_l, rows, num_tokens, num_experts, probs_ptr, weights_ptr, ids_ptr,
                TOP_K, K_P2, E_P2, BLOCK_T, NORM, False)


def _route_warps(block_t: int, e_p2: int) -> int:
    # one warp holds a token's 128 experts in 4 registers a thread: every reduction of the k
    # passes stays inside the warp (shuffles, no shared memory, no barrier)
    return max(1, min(4, block_t * e_p2 // 512))


def _alloc_out(num_tokens: int, num_experts: int, top_k: int, dev, out):
    if out is not None:
        return out
    return (torch.empty(num_tokens, num_experts, dtype=torch.float32, device=dev),
            torch.empty(num_tokens, top_k, dtype=torch.float32, device=dev),
            torch.empty(num_tokens, top_k, dtype=torch.int32, device=dev))


def _route_triton(router_logits: torch.Tensor, top_k: int, norm_topk_prob: bool, out=None,
                  block_t: int = 1, num_warps: int | None = None):
    """One program per `block_t` tokens (1 by default: a batch of 128 is 128 programs, not 8).
    `block_t` / `num_warps` are knobs for tests and benches; the engine takes the defaults."""
    num_tokens, num_experts = router_logits.shape
    probs, weights, ids = _alloc_out(num_tokens, num_experts, top_k, router_logits.device, out)
    if num_tokens == 0:
        return probs, weights, ids
    logits = router_logits if router_logits.stride(1) == 1 else router_logits.contiguous()
    e_p2 = triton.next_power_of_2(num_experts)
    _route_kernel[(triton.cdiv(num_tokens, block_t),)](
        logits, probs, weights, ids, num_tokens, num_experts, logits.stride(0),
        TOP_K=top_k, K_P2=triton.next_power_of_2(top_k), E_P2=e_p2, BLOCK_T=block_t,
        NORM=norm_topk_prob, num_warps=num_warps or _route_warps(block_t, e_p2),
    )
    return probs, weights, ids


def route_check_out(out, n: int, num_experts: int, top_k: int) -> None:
    want = ((n, num_experts, torch.float32), (n, top_k, torch.float32), (n, top_k, torch.int32))
    for t, (rows, cols, dtype) in zip(out, want):
        if tuple(t.shape) != (rows, cols) or t.dtype != dtype or not t.is_contiguous():
            raise ValueError(f"route out tensors must be contiguous {want}")


def route(
    router_logits: torch.Tensor, top_k: int, norm_topk_prob: bool,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Router for the engine; same contract as `route_ref`. `out` = (probs, weights, ids),
    contiguous [N, E] fp32 / [N, k] fp32 / [N, k] int32: written instead of allocating (the
    probes pass slices of their per-step buffers).

    On CUDA one Triton kernel replaces torch's ~6 launches (~16 µs a layer at decode on an
    H200). Ties go to the lower expert index as torch.topk's on the CPU; its softmax and sum may
    differ from torch's in the last bit, so a near-tie may split the other way. Elsewhere
    route_ref: bit-identical to HF on the CPU.
    """
    if router_logits.dim() != 2:
        raise ValueError(f"router_logits must be [num_tokens, num_experts], got shape {tuple(router_logits.shape)}")
    num_experts = router_logits.shape[1]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")
    if out is not None:
        route_check_out(out, router_logits.shape[0], num_experts, top_k)
    if router_logits.is_cuda and num_experts <= 1024:
        return _route_triton(router_logits, top_k, norm_topk_prob, out)
    res = route_ref(router_logits, top_k, norm_topk_prob)
    if out is None:
        return res
    for dst, src in zip(out, res):
        dst.copy_(src)
    return out


# ---------------------------------------------------------------- router GEMV + routing, one launch

FUSED_MAX_TOKENS = 64  # decode batches; past this the router GEMM is a real GEMM (cuBLAS)


def route_counts(device) -> torch.Tensor:
    """The zeroed semaphores route_hidden needs, one per token tile (a tile may be one token);
    each caller keeps its own (a layer owns one), allocated before any CUDA-graph capture."""
    return torch.zeros(FUSED_MAX_TOKENS, dtype=torch.int32, device=device)


def router_tile(num_tokens: int) -> tuple[int, int, int]:
    """(tokens a program, experts a program, warps) of the fused router. One or two tokens a
    program: the routing tail runs in as many programs as there are token tiles. One warp: the
    tail's 2k reductions are then warp shuffles, not shared memory behind ~30 barriers."""
    return (1 if num_tokens == 1 else 2), 2, 1


@triton.jit
def _router_route_kernel(
    x_ptr,  # [N, H]
    w_ptr,  # [E, H] router (gate) weight
    logits_ptr,  # [N, E] fp32 scratch
    counts_ptr,  # [token tiles] int32, zero between launches
    probs_ptr, weights_ptr, ids_ptr,
    bias_ptr,  # [N, E] fp32 added to the logits (interventions: 0 or -inf), if HAS_BIAS
    res_ptr,  # [N, H] the residual stream, if FUSE_NORM (x is then the attention block's output)
    norm_w_ptr,  # [H] the post-attention RMSNorm's weight, if FUSE_NORM
    normed_ptr, res_out_ptr,  # [N, H] out, if FUSE_NORM: rms_norm(x + residual), x + residual
    num_tokens, num_experts, stride_xm, stride_wn, stride_rm, eps,
    H: tl.constexpr, TOP_K: tl.constexpr, K_P2: tl.constexpr, E_P2: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, NORM: tl.constexpr,
    HAS_BIAS: tl.constexpr = False, USE_PDL: tl.constexpr = False, FUSE_NORM: tl.constexpr = False,
):
    # 1. logits of BLOCK_E experts for BLOCK_T tokens: a GEMV over H, FMA on [BLOCK_E, BLOCK_T, BLOCK_K]
    pid_e = tl.program_id(0)
    pid_t = tl.program_id(1)
    offs_e = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + tl.minimum(offs_e, num_experts - 1)[:, None, None] * stride_wn + offs_k[None, None, :]
    x_ptrs = x_ptr + tl.minimum(rows, num_tokens - 1)[None, :, None] * stride_xm + offs_k[None, None, :]
    acc = tl.zeros([BLOCK_E, BLOCK_T, BLOCK_K], dtype=tl.float32)
    # Under PDL the router's first chunk of weights (constant) is requested before the wait for
    # the kernel that writes x; nothing is stored before it.
    if BLOCK_K <= H:
        w_first = tl.load(w_ptrs)
    else:
        w_first = tl.load(w_ptrs, mask=(offs_k < H)[None, None, :], other=0.0)
    wait_prior(USE_PDL)
    if FUSE_NORM:
        # the post-attention RMSNorm (fused_add_rms_norm's rounding points): every program needs
        # the row's sum of squares before its first product, so a first pass over the whole row
        src = tl.minimum(rows, num_tokens - 1)[None, :, None]
        r_ptrs = res_ptr + src * stride_rm + offs_k[None, None, :]
        sq = tl.zeros([1, BLOCK_T], dtype=tl.float32)
        for k0 in tl.static_range(0, H, BLOCK_K):
            k_ok = (k0 + offs_k < H)[None, None, :]
            s = (tl.load(x_ptrs + k0, mask=k_ok, other=0.0).to(tl.float32)
                 + tl.load(r_ptrs + k0, mask=k_ok, other=0.0).to(tl.float32))
            s = s.to(x_ptr.dtype.element_ty).to(tl.float32)   # HF adds in the model dtype
            sq += tl.sum(s * s, axis=2)
        rstd = tl.rsqrt(sq / H + eps)[:, :, None]             # [1, BLOCK_T, 1]
        # the programs of the first expert block store the normed rows and the residual stream
        out_rows = ((rows < num_tokens) & (rows * 0 + pid_e == 0))[None, :, None]
        out_off = rows[None, :, None] * H + offs_k[None, None, :]
    for k0 in tl.static_range(0, H, BLOCK_K):
        if k0 + BLOCK_K <= H:
            if k0 == 0:
                w = w_first
            else:
                w = tl.load(w_ptrs + k0)
            if FUSE_NORM:
                k_ok = (k0 + offs_k < H)[None, None, :]
            else:
                x = tl.load(x_ptrs + k0)
        else:
            k_ok = (k0 + offs_k < H)[None, None, :]
            if k0 == 0:
                w = w_first
            else:
                w = tl.load(w_ptrs + k0, mask=k_ok, other=0.0)
            if not FUSE_NORM:
                x = tl.load(x_ptrs + k0, mask=k_ok, other=0.0)
        if FUSE_NORM:
            s = (tl.load(x_ptrs + k0, mask=k_ok, other=0.0).to(tl.float32)
                 + tl.load(r_ptrs + k0, mask=k_ok, other=0.0).to(tl.float32)).to(x_ptr.dtype.element_ty)
            g = tl.load(norm_w_ptr + k0 + offs_k, mask=k0 + offs_k < H, other=0.0).to(tl.float32)
            # HF: weight * (x * rstd).to(dtype), rounded to the dtype again
            x = ((s.to(tl.float32) * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
                 * g[None, None, :]).to(x_ptr.dtype.element_ty)
            tl.store(normed_ptr + out_off + k0, x, mask=out_rows & k_ok)
            tl.store(res_out_ptr + out_off + k0, s, mask=out_rows & k_ok)
        acc += w.to(tl.float32) * x.to(tl.float32)
    # rounded to x's dtype, as the router's F.linear output is, then kept in fp32
    logits = tl.sum(acc, axis=2).to(x_ptr.dtype.element_ty).to(tl.float32)  # [BLOCK_E, BLOCK_T]
    if HAS_BIAS:    # after the rounding: the same logits as route(F.linear(x, w) + bias)
        logits += tl.load(bias_ptr + tl.minimum(rows, num_tokens - 1)[None, :] * num_experts
                          + tl.minimum(offs_e, num_experts - 1)[:, None])
    tl.store(logits_ptr + rows[None, :] * num_experts + offs_e[:, None], logits,
             mask=(offs_e < num_experts)[:, None] & (rows < num_tokens)[None, :])
    # 2. the program that finishes a token tile last routes it. The barrier orders every thread's
    # logits store before the release of the atomic; its acquire orders the reads after it.
    tl.debug_barrier()
    done = tl.atomic_add(counts_ptr + pid_t, 1, sem="acq_rel")
    if done == tl.num_programs(0) - 1:
        _route_rows(logits_ptr, num_experts, rows, num_tokens, num_experts, probs_ptr, weights_ptr,
                    ids_ptr, TOP_K, K_P2, E_P2, BLOCK_T, NORM, True)
        tl.atomic_xchg(counts_ptr + pid_t, 0)  # ready for the next launch (or graph replay)


def route_hidden(
    x: torch.Tensor, gate_weight: torch.Tensor, top_k: int, norm_topk_prob: bool,
    counts: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    bias: torch.Tensor | None = None, tile: tuple[int, int, int] | None = None, pdl: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """route(F.linear(x, gate_weight), ...) in one launch for decode batches (N <= FUSED_MAX_TOKENS):
    programs over (expert rows, token tiles) compute the logits, and the last program to finish
    a token tile (an atomic count in `counts`, from route_counts) routes it. x [N, H],
    gate_weight [E, H] (unit stride along H). Graph-safe: the counts reset themselves. `bias`
    [N, E] contiguous fp32 is added to the logits (interventions mask experts); `tile` =
    (tokens, experts, warps) overrides router_tile (benches only)."""
    return _route_hidden(x, gate_weight, top_k, norm_topk_prob, counts, out, bias, tile, pdl)[:3]


def norm_route_hidden(
    hidden: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
    gate_weight: torch.Tensor, top_k: int, norm_topk_prob: bool, counts: torch.Tensor,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    bias: torch.Tensor | None = None, tile: tuple[int, int, int] | None = None, pdl: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The post-attention norm and the router in one launch: (probs, topk weights, topk ids,
    normed, residual_out) with normed, residual_out = fused_add_rms_norm(hidden, residual,
    norm_weight, eps) (its rounding points) and the routing of route_hidden(normed, ...).
    hidden, residual [N, H] with unit stride along H."""
    if residual.shape != hidden.shape or residual.stride(1) != 1 or residual.dtype != hidden.dtype:
        raise ValueError(f"residual {tuple(residual.shape)} must match hidden {tuple(hidden.shape)} "
                         f"(dtype and unit stride along H)")
    if norm_weight.shape != (hidden.shape[1],) or not norm_weight.is_contiguous():
        raise ValueError(f"norm_weight must be contiguous [{hidden.shape[1]}]")
    return _route_hidden(hidden, gate_weight, top_k, norm_topk_prob, counts, out, bias, tile, pdl,
                         (residual, norm_weight, float(eps)))


def _route_hidden(x, gate_weight, top_k, norm_topk_prob, counts, out, bias, tile, pdl, norm=None):
    """route_hidden, with the post-attention norm folded in when `norm` = (residual, weight, eps)."""
    num_tokens, hidden = x.shape
    num_experts = gate_weight.shape[0]
    if not 0 < num_tokens <= FUSED_MAX_TOKENS:
        raise ValueError(f"route_hidden is for 1..{FUSED_MAX_TOKENS} tokens, got {num_tokens}: "
                         f"use route(F.linear(x, gate_weight), ...)")
    if gate_weight.shape[1] != hidden or gate_weight.stride(1) != 1 or x.stride(1) != 1:
        raise ValueError(f"x {tuple(x.shape)} and gate_weight {tuple(gate_weight.shape)} must share H "
                         f"with unit stride along it")
    block_t, block_e, num_warps = tile or router_tile(num_tokens)
    if counts.dtype != torch.int32 or counts.numel() < triton.cdiv(num_tokens, block_t):
        raise ValueError("counts must be route_counts(device)")
    dev = x.device
    if out is not None:
        route_check_out(out, num_tokens, num_experts, top_k)
    probs, weights, ids = _alloc_out(num_tokens, num_experts, top_k, dev, out)
    if bias is not None and (tuple(bias.shape) != (num_tokens, num_experts)
                             or bias.dtype != torch.float32 or not bias.is_contiguous()):
        raise ValueError(f"bias must be contiguous fp32 [{num_tokens}, {num_experts}]")
    logits = torch.empty(num_tokens, num_experts, dtype=torch.float32, device=dev)
    e_p2 = triton.next_power_of_2(num_experts)
    pdl = use_pdl(x, pdl)
    # the GEMV accumulator [BLOCK_E, BLOCK_T, BLOCK_K] stays within 8192 fp32 (64 a thread at 4 warps)
    block_k = min(512 if x.element_size() <= 2 else 256, 8192 // (block_e * block_t),
                  triton.next_power_of_2(hidden))
    if norm is not None:
        residual, norm_weight, eps = norm
        normed = torch.empty(x.shape, dtype=x.dtype, device=x.device)   # rows of H: the kernel's layout
        res_out = torch.empty_like(normed)
    else:   # placeholders, never read or written
        residual, norm_weight, eps, normed, res_out = x, x, 0.0, x, x
    _router_route_kernel[(triton.cdiv(num_experts, block_e), triton.cdiv(num_tokens, block_t))](
        x, gate_weight, logits, counts, probs, weights, ids,
        bias if bias is not None else logits,
        residual, norm_weight, normed, res_out,
        num_tokens, num_experts, x.stride(0), gate_weight.stride(0), residual.stride(0), eps,
        H=hidden, TOP_K=top_k, K_P2=triton.next_power_of_2(top_k), E_P2=e_p2, BLOCK_E=block_e,
        BLOCK_T=block_t, BLOCK_K=block_k, NORM=norm_topk_prob, HAS_BIAS=bias is not None,
        USE_PDL=pdl, FUSE_NORM=norm is not None, num_warps=num_warps, launch_pdl=pdl,
    )
    return probs, weights, ids, normed, res_out
