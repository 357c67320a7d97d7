"""Introspection: the attention row of one watched query over its whole context, from the paged K cache.

Two graph-safe launches over a fixed-size output [A, Hq, max_context] for A layers at once: the
first writes each tile's raw scores and (max, sum-exp), the second merges those and normalises
in place. The context length is read on the device, so a captured graph replays for any length
<= max_context.
"""
import math

import torch
import triton
import triton.language as tl

from engine.kernels.decode_attention import dot_precision, gather_context

BLOCK_N = 64
BLOCK_OUT = 512     # output positions per normalize program (zero-filling past the context)
_STATS: dict[tuple, torch.Tensor] = {}


@triton.jit
def _probe_scores_kernel(
    q_ptr, k_cache_ptr, layer_ids_ptr, block_table_ptr, context_len_ptr, out_ptr, stats_ptr,
    scale_log2, max_context, max_blocks, num_tiles, num_kv_heads, num_q_heads,
    stride_qa, stride_qh, stride_cl, stride_cb, stride_cs, stride_ch, stride_oa, stride_oh,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr,
):
    slot = tl.program_id(0) // num_kv_heads     # which captured layer
    kvh = tl.program_id(0) % num_kv_heads
    tile = tl.program_id(1)
    layer = tl.load(layer_ids_ptr + slot).to(tl.int64)
    ctx = tl.minimum(tl.load(context_len_ptr), max_blocks * PAGE_SIZE)
    if tile * BLOCK_N >= ctx:
        return  # past the context: the output is sized for the longest one; normalize zeroes it
    t = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    valid = t < ctx
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kvh * GROUP + g
    row_mask = g < GROUP
    d_mask = d < HEAD_DIM
    q = tl.load(q_ptr + slot * stride_qa + heads[:, None] * stride_qh + d[None, :],
                mask=row_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_G, BLOCK_D]
    block = tl.load(block_table_ptr + t // PAGE_SIZE, mask=valid, other=0).to(tl.int64)
    kv_off = layer * stride_cl + block * stride_cb + (t % PAGE_SIZE) * stride_cs + kvh * stride_ch
    k = tl.load(k_cache_ptr + kv_off[:, None] + d[None, :], mask=valid[:, None] & d_mask[None, :], other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * scale_log2  # [BLOCK_G, BLOCK_N], log2 domain
    s = tl.where(valid[None, :], s, float("-inf"))
    m = tl.max(s, axis=1)
    l = tl.sum(tl.exp2(s - tl.where(m == float("-inf"), 0.0, m)[:, None]), axis=1)
    tl.store(out_ptr + slot * stride_oa + heads[:, None] * stride_oh + t[None, :], s,
             mask=row_mask[:, None] & (t < max_context)[None, :])
    stat = ((slot * num_q_heads + heads) * num_tiles + tile) * 2  # stats [A, Hq, tiles, 2]
    tl.store(stats_ptr + stat, m, mask=row_mask)
    tl.store(stats_ptr + stat + 1, l, mask=row_mask)


@triton.jit
def _probe_normalize_kernel(
    out_ptr, stats_ptr, context_len_ptr, max_context, max_blocks, num_tiles, num_q_heads,
    stride_oa, stride_oh,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_OUT: tl.constexpr,
):
    row = tl.program_id(0)                      # slot * Hq + head
    chunk = tl.program_id(1)                    # BLOCK_OUT positions of the output row
    ctx = tl.minimum(tl.load(context_len_ptr), max_blocks * PAGE_SIZE)
    t = chunk * BLOCK_OUT + tl.arange(0, BLOCK_OUT)
    ptr = out_ptr + (row // num_q_heads) * stride_oa + (row % num_q_heads) * stride_oh + t
    if chunk * BLOCK_OUT >= ctx:                # wholly past the context: zeros, nothing to read
        tl.store(ptr, tl.zeros([BLOCK_OUT], dtype=tl.float32), mask=t < max_context)
        return
    # only the tiles the scores kernel wrote (those below ctx) carry statistics
    i = tl.arange(0, BLOCK_T)
    live = i < tl.minimum(num_tiles, tl.cdiv(ctx, BLOCK_N))
    m_all = tl.load(stats_ptr + (row * num_tiles + i) * 2, mask=live, other=float("-inf"))
    l_all = tl.load(stats_ptr + (row * num_tiles + i) * 2 + 1, mask=live, other=0.0)
    m = tl.max(m_all, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)
    l = tl.sum(l_all * tl.exp2(m_all - m), axis=0)
    l = tl.where(l == 0.0, 1.0, l)
    s = tl.load(ptr, mask=t < ctx, other=float("-inf"))
    tl.store(ptr, tl.exp2(s - m) / l, mask=t < max_context)


def attention_probs_layers(
    q: torch.Tensor,            # [A, Hq, D]: the watched query at each of A layers
    k_all: torch.Tensor,        # [L, num_blocks, block_size, Hkv, D]: every layer's K cache
    layer_ids: torch.Tensor,    # [A] int32 on the device: the layer of each q row
    block_table: torch.Tensor,  # [max_blocks] int32
    context_len: torch.Tensor,  # [1] int32 on the device
    scale: float,
    out: torch.Tensor,          # [A, Hq, max_context] fp32, preallocated
) -> torch.Tensor:
    """All captured layers in two launches: the probe runs once after the forward, over the K
    cache that by then holds this step's keys for every layer (one launch pair per layer would
    cost more than the attention row is worth at batch 1)."""
    num_slots, num_q_heads, head_dim = q.shape
    _, _, page_size, num_kv_heads, _ = k_all.shape
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if out.dtype != torch.float32 or out.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("attention_probs writes into an fp32 out; q and out need a contiguous last dim")
    group = num_q_heads // num_kv_heads
    max_context = out.shape[-1]
    num_tiles = triton.cdiv(max_context, BLOCK_N)
    key = (q.device, num_slots, num_q_heads, num_tiles)
    if key not in _STATS:
        _STATS[key] = torch.empty(num_slots, num_q_heads, num_tiles, 2, dtype=torch.float32,
                                  device=q.device)
    stats = _STATS[key]
    _probe_scores_kernel[(num_slots * num_kv_heads, num_tiles)](
        q, k_all, layer_ids, block_table, context_len, out, stats,
        scale * math.log2(math.e), max_context, block_table.shape[0], num_tiles, num_kv_heads,
        num_q_heads, q.stride(0), q.stride(1), k_all.stride(0), k_all.stride(1), k_all.stride(2),
        k_all.stride(3), out.stride(0), out.stride(1),
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), PAGE_SIZE=page_size, BLOCK_N=BLOCK_N,
        DOT_PREC=dot_precision(q.dtype), num_warps=4,
    )
    _probe_normalize_kernel[(num_slots * num_q_heads, triton.cdiv(max_context, BLOCK_OUT))](
        out, stats, context_len, max_context, block_table.shape[0], num_tiles, num_q_heads,
        out.stride(0), out.stride(1), PAGE_SIZE=page_size, BLOCK_N=BLOCK_N,
        BLOCK_T=triton.next_power_of_2(num_tiles), BLOCK_OUT=BLOCK_OUT, num_warps=4,
    )
    return out


_LAYER0: dict[torch.device, torch.Tensor] = {}


def attention_probs(
    q: torch.Tensor,            # [Hq, D], the watched query
    k_cache: torch.Tensor,      # [num_blocks, block_size, Hkv, D]
    block_table: torch.Tensor,  # [max_blocks] int32
    context_len: torch.Tensor,  # [1] int32 on the device
    scale: float,
    out: torch.Tensor,          # [Hq, max_context] fp32, preallocated
) -> torch.Tensor:
    """One layer: attention_probs_layers with a single slot."""
    if q.device not in _LAYER0:
        _LAYER0[q.device] = torch.zeros(1, dtype=torch.int32, device=q.device)
    attention_probs_layers(q[None], k_cache[None], _LAYER0[q.device], block_table, context_len,
                           scale, out[None])
    return out


def attention_probs_layers_ref(
    q: torch.Tensor, k_all: torch.Tensor, layer_ids: torch.Tensor, block_table: torch.Tensor,
    context_len: torch.Tensor, scale: float, out: torch.Tensor,
) -> torch.Tensor:
    """Torch reference (and the CPU path) of attention_probs_layers: one layer at a time."""
    for i, layer in enumerate(layer_ids.tolist()):
        attention_probs_ref(q[i], k_all[layer], block_table, context_len, scale, out[i])
    return out


def attention_probs_ref(
    q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor, context_len: torch.Tensor,
    scale: float, out: torch.Tensor,
) -> torch.Tensor:
    """Torch reference (and the CPU path); vectorised over the fixed max_context, no host read."""
    num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    max_context = out.shape[1]
    span = min(max_context, block_table.shape[0] * k_cache.shape[1])
    k = gather_context(k_cache, block_table[None], span)[0].float()  # [span, Hkv, D]
    k = k.repeat_interleave(num_q_heads // num_kv_heads, dim=1)      # [span, Hq, D]
    scores = torch.einsum("hd,thd->ht", q.float(), k) * scale        # [Hq, span]
    valid = torch.arange(span, device=q.device) < context_len.to(q.device)
    probs = torch.softmax(scores.masked_fill(~valid, float("-inf")), dim=-1).nan_to_num_(0.0)
    out.zero_()
    out[:, :span] = probs
    return out


def block_mass(probs: torch.Tensor, block_size: int) -> torch.Tensor:
    """[Hq, max_context] probabilities -> [Hq, num_blocks] attention mass per KV block."""
    num_heads, max_context = probs.shape
    num_blocks = triton.cdiv(max_context, block_size)
    padded = torch.nn.functional.pad(probs, (0, num_blocks * block_size - max_context))
    return padded.view(num_heads, num_blocks, block_size).sum(-1)
