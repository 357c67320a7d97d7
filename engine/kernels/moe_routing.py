"""MoE router: softmax over experts, top-k, optional renormalisation — HF Qwen2/3-MoE routing."""

import torch
import triton
import triton.language as tl


def route_ref(
    router_logits: torch.Tensor, top_k: int, norm_topk_prob: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """HF's routing, op for op (Qwen3MoeTopKRouter / Qwen2MoeTopKRouter).

    router_logits: [num_tokens, num_experts], any float dtype.
    Returns probs [num_tokens, num_experts] fp32, topk_weights [num_tokens, top_k] fp32,
    topk_ids [num_tokens, top_k] int32. HF then casts the weights to the logits' dtype
    (`router_top_value.to(router_logits.dtype)`); we keep fp32 and let the caller cast, so
    in fp32 this is bit-identical and in bf16 the caller decides where rounding happens.
    """
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)  # [N, E]
    topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)  # [N, k]
    if norm_topk_prob:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return probs, topk_weights, topk_ids.to(torch.int32)


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


def _route_triton(router_logits: torch.Tensor, top_k: int, norm_topk_prob: bool, out=None):
    num_tokens, num_experts = router_logits.shape
    dev = router_logits.device
    if out is not None:
        probs, weights, ids = out
    else:
        probs = torch.empty(num_tokens, num_experts, dtype=torch.float32, device=dev)
        weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=dev)
        ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=dev)
    if num_tokens == 0:
        return probs, weights, ids
    logits = router_logits if router_logits.stride(1) == 1 else router_logits.contiguous()
    e_p2 = triton.next_power_of_2(num_experts)
    block_t = max(2, min(16, 4096 // e_p2, triton.next_power_of_2(num_tokens)))
    chunk = _chunk(block_t, e_p2)
    _route_kernel[(triton.cdiv(num_tokens, block_t),)](
        logits, probs, weights, ids, num_tokens, num_experts, logits.stride(0),
        TOP_K=top_k, E_P2=e_p2, BLOCK_T=block_t, CHUNK=chunk, NORM=norm_topk_prob,
        num_warps=4,
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
    """Router for the engine; same contract as `route_ref`.

    `out` = (probs, weights, ids), contiguous [N, E] fp32 / [N, k] fp32 / [N, k] int32: write
    there instead of allocating. The probes pass slices of their per-step buffers, so recording
    routing costs no launch.

    On CUDA one Triton kernel replaces torch's ~6 launches (softmax, topk, sort, sum, div, cast:
    ~16 µs per layer at decode on an H200). Same experts as torch.topk except on exact ties,
    which go to the lower expert index (torch's order among ties is unspecified); the
    renormalising sum may differ from torch's in the last bit. Elsewhere, route_ref:
    bit-identical to HF on the CPU.
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
_ROUTER_TOKENS = 8     # tokens per program: the GEMV accumulator is [BLOCK_E, tokens, BLOCK_K]


def route_counts(device) -> torch.Tensor:
    """The zeroed semaphores route_hidden needs, one per token tile; each caller keeps its own
    (a layer owns one), allocated before any CUDA-graph capture."""
    return torch.zeros(triton.cdiv(FUSED_MAX_TOKENS, _ROUTER_TOKENS), dtype=torch.int32, device=device)


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


def route_hidden(
    x: torch.Tensor, gate_weight: torch.Tensor, top_k: int, norm_topk_prob: bool,
    counts: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """route(F.linear(x, gate_weight), ...) in one launch for decode batches (N <= FUSED_MAX_TOKENS):
    programs over (expert rows, token tiles) compute the logits, and the last program to finish
    a token tile (an atomic count in `counts`, from route_counts) routes it. Saves the router
    GEMM's own launch per MoE layer. x [N, H], gate_weight [E, H] (unit stride along H).
    Graph-safe: fixed grid, no host sync; the counts reset themselves. `bias` [N, E] fp32
    (contiguous) is added to the logits before the softmax (interventions mask experts)."""
    num_tokens, hidden = x.shape
    num_experts = gate_weight.shape[0]
    if not 0 < num_tokens <= FUSED_MAX_TOKENS:
        raise ValueError(f"route_hidden is for 1..{FUSED_MAX_TOKENS} tokens, got {num_tokens}: "
                         f"use route(F.linear(x, gate_weight), ...)")
    if gate_weight.shape[1] != hidden or gate_weight.stride(1) != 1 or x.stride(1) != 1:
        raise ValueError(f"x {tuple(x.shape)} and gate_weight {tuple(gate_weight.shape)} must share H "
                         f"with unit stride along it")
    if counts.dtype != torch.int32 or counts.numel() < triton.cdiv(num_tokens, _ROUTER_TOKENS):
        raise ValueError("counts must be route_counts(device)")
    dev = x.device
    if out is not None:
        route_check_out(out, num_tokens, num_experts, top_k)
        probs, weights, ids = out
    else:
        probs = torch.empty(num_tokens, num_experts, dtype=torch.float32, device=dev)
        weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=dev)
        ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=dev)
    if bias is not None and (tuple(bias.shape) != (num_tokens, num_experts)
                             or bias.dtype != torch.float32 or not bias.is_contiguous()):
        raise ValueError(f"bias must be contiguous fp32 [{num_tokens}, {num_experts}]")
    logits = torch.empty(num_tokens, num_experts, dtype=torch.float32, device=dev)
    e_p2 = triton.next_power_of_2(num_experts)
    block_t = max(2, min(_ROUTER_TOKENS, triton.next_power_of_2(num_tokens)))
    block_e = 2
    block_k = min(512 if x.element_size() <= 2 else 256, triton.next_power_of_2(hidden))
    _router_route_kernel[(triton.cdiv(num_experts, block_e), triton.cdiv(num_tokens, block_t))](
        x, gate_weight, logits, counts, probs, weights, ids,
        bias if bias is not None else logits,
        num_tokens, num_experts, x.stride(0), gate_weight.stride(0),
        H=hidden, TOP_K=top_k, E_P2=e_p2, BLOCK_E=block_e, BLOCK_T=block_t, BLOCK_K=block_k,
        CHUNK=_chunk(block_t, e_p2), NORM=norm_topk_prob, HAS_BIAS=bias is not None,
        num_warps=4,
    )
    return probs, weights, ids
