"""One launch per layer between the QKV projection and attention: per-head q/k RMSNorm (Qwen3),
RoPE, and the K/V store into the paged cache, read straight from the fused qkv output, where
unfused it is four launches and two [N, H, D] round trips. The rounding points are the unfused
ones (rmsnorm.py, rotary.py). Optionally it also copies the q rows the attention probe watches
into a probe buffer."""
import torch
import triton
import triton.language as tl

from .pdl import use_pdl, wait_prior
from .rmsnorm import rms_norm_ref
from .rotary import apply_rotary_ref
from .store_kvcache import store_kvcache_ref


@triton.jit
def _norm_rotate(base, num_heads, pos_cos, pos_sin, w1, w2, eps, norm_size,
                 HEAD_DIM: tl.constexpr, HALF: tl.constexpr, HAS_NORM: tl.constexpr,
                 BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """The heads of one token at `base` (head stride HEAD_DIM) -> rotated halves, fp32."""
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (h < num_heads) & (d < HALF)
    x1 = tl.load(base + h * HEAD_DIM + d, mask=mask, other=0.0)
    x2 = tl.load(base + h * HEAD_DIM + HALF + d, mask=mask, other=0.0)
    if HAS_NORM:
        # the sum of squares over whole rows, as rms_norm's kernel sums them (same order)
        full = tl.arange(0, BLOCK_D)[None, :]
        xr = tl.load(base + h * HEAD_DIM + full, mask=(h < num_heads) & (full < HEAD_DIM),
                     other=0.0).to(tl.float32)
        # divided by a runtime size as rms_norm's kernel does (a constexpr might fold otherwise)
        rstd = tl.rsqrt(tl.sum(xr * xr, axis=1) / norm_size + eps)[:, None]
        n1 = (x1.to(tl.float32) * rstd).to(x1.dtype)  # HF rounds before the weight
        n2 = (x2.to(tl.float32) * rstd).to(x1.dtype)
        x1 = (n1.to(tl.float32) * w1).to(x1.dtype)    # the unfused norm stores the dtype value
        x2 = (n2.to(tl.float32) * w2).to(x1.dtype)
    x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
    return x1f * pos_cos - x2f * pos_sin, x2f * pos_cos + x1f * pos_sin


@triton.jit
def _qk_norm_rope_store_kernel(
    qkv_ptr, pos_ptr, cache_ptr, slot_ptr, q_norm_ptr, k_norm_ptr,
    q_out_ptr, k_cache_ptr, v_cache_ptr, probe_rows_ptr, probe_q_ptr,
    stride_qkv, stride_cache, stride_qo_n, stride_qo_h,
    stride_cb, stride_cs, stride_ch,  # k_cache and v_cache share one layout
    stride_pq_r, stride_pq_h,
    num_q_heads, num_kv_heads, eps, norm_size,
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    HAS_NORM: tl.constexpr, NUM_PROBE_ROWS: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_HALF: tl.constexpr, USE_PDL: tl.constexpr,
):
    wait_prior(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)[None, :]
    cos = tl.load(cache_ptr + pos * stride_cache + d, mask=d < HALF, other=0.0)
    sin = tl.load(cache_ptr + pos * stride_cache + HALF + d, mask=d < HALF, other=0.0)
    if HAS_NORM:
        qw1 = tl.load(q_norm_ptr + d, mask=d < HALF, other=0.0).to(tl.float32)
        qw2 = tl.load(q_norm_ptr + HALF + d, mask=d < HALF, other=0.0).to(tl.float32)
        kw1 = tl.load(k_norm_ptr + d, mask=d < HALF, other=0.0).to(tl.float32)
        kw2 = tl.load(k_norm_ptr + HALF + d, mask=d < HALF, other=0.0).to(tl.float32)
    else:  # unused placeholders
        qw1, qw2, kw1, kw2 = cos, cos, cos, cos
    row = qkv_ptr + token * stride_qkv  # [q heads | k heads | v heads], each HEAD_DIM wide

    # q: normed, rotated, written for attention (and for the probe when it watches this row)
    q1, q2 = _norm_rotate(row, num_q_heads, cos, sin, qw1, qw2, eps, norm_size,
                          HEAD_DIM, HALF, HAS_NORM, BLOCK_HQ, BLOCK_D, BLOCK_HALF)
    q1 = q1.to(qkv_ptr.dtype.element_ty).to(q_out_ptr.dtype.element_ty)  # the unfused q's dtype
    q2 = q2.to(qkv_ptr.dtype.element_ty).to(q_out_ptr.dtype.element_ty)
    hq = tl.arange(0, BLOCK_HQ)[:, None]
    q_mask = (hq < num_q_heads) & (d < HALF)
    q_dst = q_out_ptr + token * stride_qo_n + hq * stride_qo_h + d
    tl.store(q_dst, q1, mask=q_mask)
    tl.store(q_dst + HALF, q2, mask=q_mask)
    for r in tl.static_range(NUM_PROBE_ROWS):
        # rows are read on the device, so a CUDA graph replays with new ones; -1 matches nothing
        if tl.load(probe_rows_ptr + r).to(tl.int64) == token:
            p_dst = probe_q_ptr + r * stride_pq_r + hq * stride_pq_h + d
            tl.store(p_dst, q1, mask=q_mask)
            tl.store(p_dst + HALF, q2, mask=q_mask)

    # k and v: into the paged cache; slot < 0 is a padding token (int64: big caches pass 2^31)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:
        k1, k2 = _norm_rotate(row + num_q_heads * HEAD_DIM, num_kv_heads, cos, sin, kw1, kw2,
                              eps, norm_size, HEAD_DIM, HALF, HAS_NORM, BLOCK_HK, BLOCK_D, BLOCK_HALF)
        hk = tl.arange(0, BLOCK_HK)[:, None]
        kv_mask = (hk < num_kv_heads) & (d < HALF)
        dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + hk * stride_ch + d
        k1 = k1.to(qkv_ptr.dtype.element_ty)  # the unfused path stores the rotated dtype value
        k2 = k2.to(qkv_ptr.dtype.element_ty)
        tl.store(k_cache_ptr + dst, k1.to(k_cache_ptr.dtype.element_ty), mask=kv_mask)
        tl.store(k_cache_ptr + dst + HALF, k2.to(k_cache_ptr.dtype.element_ty), mask=kv_mask)
        v_src = row + (num_q_heads + num_kv_heads) * HEAD_DIM + hk * HEAD_DIM + d
        v1 = tl.load(v_src, mask=kv_mask)
        v2 = tl.load(v_src + HALF, mask=kv_mask)
        tl.store(v_cache_ptr + dst, v1.to(v_cache_ptr.dtype.element_ty), mask=kv_mask)
        tl.store(v_cache_ptr + dst + HALF, v2.to(v_cache_ptr.dtype.element_ty), mask=kv_mask)


def _check(qkv, num_q_heads, num_kv_heads, head_dim, k_cache, v_cache, cos_sin_cache, probe):
    width = (num_q_heads + 2 * num_kv_heads) * head_dim
    if qkv.dim() != 2 or qkv.shape[1] != width:
        raise ValueError(f"qkv must be [N, (Hq + 2 Hkv) * D] = [N, {width}], got {tuple(qkv.shape)}")
    if qkv.stride(1) != 1:
        raise ValueError("qkv needs a contiguous last dim (any row stride is fine)")
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache must share one layout with a contiguous head_dim")
    if tuple(k_cache.shape[2:]) != (num_kv_heads, head_dim):
        raise ValueError(f"k_cache must be [blocks, block_size, {num_kv_heads}, {head_dim}], "
                         f"got {tuple(k_cache.shape)}")
    if cos_sin_cache.dtype != torch.float32 or cos_sin_cache.stride(-1) != 1 \
            or cos_sin_cache.shape[-1] != head_dim:
        raise ValueError(f"cos_sin_cache must be fp32 [max_positions, {head_dim}] with a "
                         "contiguous last dim (build_cos_sin_cache makes one)")
    rows, out = probe
    if (rows is None) != (out is None):
        raise ValueError("probe_rows and probe_q come together: pass both or neither")
    if rows is not None and (out.dim() != 3 or out.shape[0] != rows.numel()
                             or tuple(out.shape[1:]) != (num_q_heads, head_dim)
                             or out.stride(-1) != 1):
        raise ValueError(f"probe_q must be [{rows.numel()}, {num_q_heads}, {head_dim}] "
                         f"(one row per probe row) with a contiguous head_dim")


def qk_norm_rope_store(
    qkv: torch.Tensor,            # [N, (Hq + 2 Hkv) * D]: the fused projection (any row stride)
    positions: torch.Tensor,      # [N] int32/int64
    cos_sin_cache: torch.Tensor,  # [max_positions, D] fp32: cos | sin
    k_cache: torch.Tensor,        # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,        # [num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,   # [N] int32/int64; slot = block_id * block_size + offset, < 0 skips
    num_q_heads: int,
    num_kv_heads: int,
    q_norm_weight: torch.Tensor | None = None,  # [D] (Qwen3) or None (Qwen2: no q/k norm)
    k_norm_weight: torch.Tensor | None = None,  # [D]
    eps: float = 1e-6,
    probe_rows: torch.Tensor | None = None,  # [R] int64 on the device: token rows to copy, -1 = none
    probe_q: torch.Tensor | None = None,     # [R, Hq, D]: receives q of those rows
    q_out: torch.Tensor | None = None,       # [N, Hq, D] to write into; a new tensor by default
    pdl: bool = True,             # launch with PDL where the GPU has it (KernelConfig.pdl)
) -> torch.Tensor:                # [N, Hq, D] q, normed and rotated; K/V are in the cache
    num_tokens = qkv.shape[0]
    head_dim = cos_sin_cache.shape[-1]
    if probe_rows is not None:
        probe_rows = probe_rows.reshape(-1)
    _check(qkv, num_q_heads, num_kv_heads, head_dim, k_cache, v_cache, cos_sin_cache,
           (probe_rows, probe_q))
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("q_norm_weight and k_norm_weight come together (Qwen3) or not at all")
    if q_out is None:
        q_out = torch.empty(num_tokens, num_q_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if num_tokens == 0:
        return q_out
    has_norm = q_norm_weight is not None
    num_probe_rows = 0 if probe_rows is None else probe_rows.numel()
    half = head_dim // 2
    pdl = use_pdl(qkv, pdl)
    _qk_norm_rope_store_kernel[(num_tokens,)](
        qkv, positions, cos_sin_cache, slot_mapping,
        q_norm_weight if has_norm else cos_sin_cache, k_norm_weight if has_norm else cos_sin_cache,
        q_out, k_cache, v_cache,
        probe_rows if num_probe_rows else slot_mapping, probe_q if num_probe_rows else q_out,
        qkv.stride(0), cos_sin_cache.stride(0), q_out.stride(0), q_out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        probe_q.stride(0) if num_probe_rows else 0, probe_q.stride(1) if num_probe_rows else 0,
        num_q_heads, num_kv_heads, eps, head_dim,
        HEAD_DIM=head_dim, HALF=half, BLOCK_SIZE=k_cache.shape[1],
        HAS_NORM=has_norm, NUM_PROBE_ROWS=num_probe_rows,
        BLOCK_HQ=triton.next_power_of_2(num_q_heads), BLOCK_HK=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_HALF=triton.next_power_of_2(half),
        USE_PDL=pdl, num_warps=4 if num_q_heads * head_dim >= 2048 else 2, launch_pdl=pdl,
    )
    return q_out


def qk_norm_rope_store_ref(
    qkv: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    num_q_heads: int, num_kv_heads: int,
    q_norm_weight: torch.Tensor | None = None, k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6, probe_rows: torch.Tensor | None = None,
    probe_q: torch.Tensor | None = None, q_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Torch reference: the unfused CPU sequence of QwenAttention (split, q/k norm, rotary,
    store), step for step, plus the probe copy."""
    n, d = qkv.shape[0], cos_sin_cache.shape[-1]
    q, k, v = qkv.split([num_q_heads * d, num_kv_heads * d, num_kv_heads * d], -1)
    q, k, v = q.reshape(n, num_q_heads, d), k.reshape(n, num_kv_heads, d), v.reshape(n, num_kv_heads, d)
    if q_norm_weight is not None:
        q = rms_norm_ref(q, q_norm_weight, eps)
        k = rms_norm_ref(k, k_norm_weight, eps)
    q, k = apply_rotary_ref(q.clone(), k.clone(), positions, cos_sin_cache)
    store_kvcache_ref(k, v, k_cache, v_cache, slot_mapping)
    if probe_rows is not None:
        rows = probe_rows.reshape(-1).long()
        hit = (rows >= 0) & (rows < n)
        probe_q[hit] = q[rows[hit]].to(probe_q.dtype)
    if q_out is None:
        return q
    q_out.copy_(q)
    return q_out
