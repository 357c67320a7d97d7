"""The router kernels before #26, kept only as bench/router.py's baseline (the engine uses
engine/kernels/moe_routing.py): top-k by ranking every expert against every other, 16 tokens a
program for route, 8-token tiles for the fused router GEMV + routing. Same contract and outputs
as the engine's (they agree but on exact ties of probabilities whose logits differ)."""

import torch
import triton
import triton.language as tl

_ROUTER_TOKENS = 8     # tokens per program of the fused router


@triton.jit
def _route_rows(
    logits_ptr, stride_l, rows, num_tokens, num_experts, probs_ptr, weights_ptr, ids_ptr,
    TOP_K: tl.constexpr, E_P2: tl.constexpr, BLOCK_T: tl.constexpr, CHUNK: tl.constexpr,
    NORM: tl.constexpr, VOLATILE: tl.constexpr,
):
    """Softmax, top-k and renormalisation of BLOCK_T rows of logits (VOLATILE: written by other
    programs of this launch, so read them from L2, not a stale L1 line)."""
    cols = tl.arange(0, E_P2)
    row_ok = rows < num_tokens
    col_ok = cols < num_experts
    src_rows = tl.minimum(rows, num_tokens - 1)  # tail rows recompute the last token: no NaN from empty rows
    row_ptrs = logits_ptr + src_rows[:, None] * stride_l
    z = tl.load(row_ptrs + cols[None, :], mask=col_ok[None, :], other=float("-inf"),
                volatile=VOLATILE).to(tl.float32)
    e = tl.where(col_ok[None, :], tl.exp(z - tl.max(z, axis=1)[:, None]), 0.0)
    probs = e / tl.sum(e, axis=1)[:, None]  # [BLOCK_T, E_P2]
    tl.store(probs_ptr + rows[:, None] * num_experts + cols[None, :], probs,
             mask=row_ok[:, None] & col_ok[None, :])

    # Top-k in one pass: an expert's rank = how many experts beat it (a larger logit, or an equal
    # one at a lower index), counted CHUNK rivals at a time. Softmax is monotone, so this is the
    # order of the probabilities, ties to the lower expert. The k experts of rank < k are the
    # top-k, and the rank is each one's slot in the descending output. (k rounds of argmax cost
    # 2k cross-warp reductions in a row; this is one intra-warp reduction per chunk.)
    rank = tl.zeros([BLOCK_T, E_P2], dtype=tl.int32)
    for c0 in tl.static_range(0, E_P2, CHUNK):
        rivals = c0 + tl.arange(0, CHUNK)
        zr = tl.load(row_ptrs + rivals[None, :], mask=(rivals < num_experts)[None, :],
                     other=float("-inf"), volatile=VOLATILE).to(tl.float32)  # [BLOCK_T, CHUNK]
        beats = (zr[:, None, :] > z[:, :, None]) | \
            ((zr[:, None, :] == z[:, :, None]) & (rivals[None, None, :] < cols[None, :, None]))
        rank += tl.sum(beats.to(tl.int32), axis=2)
    top = (rank < TOP_K) & col_ok[None, :]
    w = probs
    if NORM:
        w = probs / tl.sum(tl.where(top, probs, 0.0), axis=1)[:, None]
    out_off = rows[:, None] * TOP_K + rank
    keep = top & row_ok[:, None]
    tl.store(weights_ptr + out_off, w, mask=keep)
    tl.store(ids_ptr + out_off, cols[None, :] + tl.zeros([BLOCK_T, E_P2], dtype=tl.int32), mask=keep)


@triton.jit
def _route_kernel(
    logits_ptr,  # [N, E]
    probs_ptr,  # [N, E] fp32 out
    weights_ptr,  # [N, TOP_K] fp32 out
    ids_ptr,  # [N, TOP_K] int32 out
    num_tokens, num_experts, stride_l,
    TOP_K: tl.constexpr, E_P2: tl.constexpr, BLOCK_T: tl.constexpr, CHUNK: tl.constexpr,
    NORM: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    _route_rows(logits_ptr, stride_l, rows, num_tokens, num_experts, probs_ptr, weights_ptr, ids_ptr,
                TOP_K, E_P2, BLOCK_T, CHUNK, NORM, False)


def _chunk(block_t: int, e_p2: int) -> int:
    return max(1, min(e_p2, 8192 // (block_t * e_p2)))  # the [BLOCK_T, E, CHUNK] compare tile: 64 per thread


@triton.jit
def _router_route_kernel(
    x_ptr,  # [N, H]
    w_ptr,  # [E, H] router (gate) weight
    logits_ptr,  # [N, E] fp32 scratch
    counts_ptr,  # [token tiles] int32, zero between launches
    probs_ptr, weights_ptr, ids_ptr,
    bias_ptr,  # [N, E] fp32 added to the logits (interventions: 0 or -inf), if HAS_BIAS
    num_tokens, num_experts, stride_xm, stride_wn,
    H: tl.constexpr, TOP_K: tl.constexpr, E_P2: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, CHUNK: tl.constexpr, NORM: tl.constexpr,
    HAS_BIAS: tl.constexpr = False,
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
    for k0 in tl.static_range(0, H, BLOCK_K):
        if k0 + BLOCK_K <= H:
            w = tl.load(w_ptrs + k0)
            x = tl.load(x_ptrs + k0)
        else:
            k_ok = (k0 + offs_k < H)[None, None, :]
            w = tl.load(w_ptrs + k0, mask=k_ok, other=0.0)
            x = tl.load(x_ptrs + k0, mask=k_ok, other=0.0)
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
                    ids_ptr, TOP_K, E_P2, BLOCK_T, CHUNK, NORM, True)
        tl.atomic_xchg(counts_ptr + pid_t, 0)  # ready for the next launch (or graph replay)


def route_old(router_logits: torch.Tensor, top_k: int, norm_topk_prob: bool):
    """router_logits [N, E] -> probs [N, E] fp32, topk_weights [N, k] fp32, topk_ids [N, k] int32."""
    num_tokens, num_experts = router_logits.shape
    dev = router_logits.device
    probs = torch.empty(num_tokens, num_experts, dtype=torch.float32, device=dev)
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=dev)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=dev)
    logits = router_logits if router_logits.stride(1) == 1 else router_logits.contiguous()
    e_p2 = triton.next_power_of_2(num_experts)
    block_t = max(2, min(16, 4096 // e_p2, triton.next_power_of_2(num_tokens)))
    _route_kernel[(triton.cdiv(num_tokens, block_t),)](
        logits, probs, weights, ids, num_tokens, num_experts, logits.stride(0),
        TOP_K=top_k, E_P2=e_p2, BLOCK_T=block_t, CHUNK=_chunk(block_t, e_p2), NORM=norm_topk_prob,
        num_warps=4,
    )
    return probs, weights, ids


def route_hidden_old(x: torch.Tensor, gate_weight: torch.Tensor, top_k: int, norm_topk_prob: bool,
                     counts: torch.Tensor):
    """route_old(F.linear(x, gate_weight), ...) in one launch, N <= 64; `counts`: zeroed int32
    semaphores, at least ceil(N / 8) of them (the engine's route_counts has enough)."""
    num_tokens, hidden = x.shape
    num_experts = gate_weight.shape[0]
    dev = x.device
    probs = torch.empty(num_tokens, num_experts, dtype=torch.float32, device=dev)
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=dev)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=dev)
    logits = torch.empty(num_tokens, num_experts, dtype=torch.float32, device=dev)
    e_p2 = triton.next_power_of_2(num_experts)
    block_t = max(2, min(_ROUTER_TOKENS, triton.next_power_of_2(num_tokens)))
    block_e = 2
    block_k = min(512 if x.element_size() <= 2 else 256, triton.next_power_of_2(hidden))
    _router_route_kernel[(triton.cdiv(num_experts, block_e), triton.cdiv(num_tokens, block_t))](
        x, gate_weight, logits, counts, probs, weights, ids, logits,
        num_tokens, num_experts, x.stride(0), gate_weight.stride(0),
        H=hidden, TOP_K=top_k, E_P2=e_p2, BLOCK_E=block_e, BLOCK_T=block_t, BLOCK_K=block_k,
        CHUNK=_chunk(block_t, e_p2), NORM=norm_topk_prob, HAS_BIAS=False,
        num_warps=4,
    )
    return probs, weights, ids
