"""Rotary position embedding (NeoX / rotate_half layout, as HF Qwen) applied to q and k in place."""
import torch
import triton
import triton.language as tl


def build_cos_sin_cache(
    head_dim: int, max_positions: int, base: float, device: torch.device | str | None = None,
) -> torch.Tensor:  # [max_positions, head_dim] fp32: cos in the first half, sin in the second
    """The same fp32 ops as HF's default rope init and Qwen3RotaryEmbedding.forward."""
    # HF builds inv_freq on the CPU and moves it; do the same so the pow rounds identically
    inv_freq = (1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float, device="cpu") / head_dim))).to(device)
    positions = torch.arange(max_positions, dtype=torch.float32, device=device)
    freqs = torch.outer(positions, inv_freq)  # [max_positions, head_dim / 2]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


@triton.jit
def _rotate_heads(ptr, stride_n, stride_h, token, num_heads, cos, sin,
                  HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (h < num_heads) & (d < HALF)
    base = ptr + token * stride_n + h * stride_h + d
    x1 = tl.load(base, mask=mask, other=0.0)
    x2 = tl.load(base + HALF, mask=mask, other=0.0)
    x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
    tl.store(base, (x1f * cos - x2f * sin).to(x1.dtype), mask=mask)
    tl.store(base + HALF, (x2f * cos + x1f * sin).to(x1.dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, pos_ptr, cache_ptr,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_cache,
    num_q_heads, num_kv_heads,
    HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)[None, :]
    cos = tl.load(cache_ptr + pos * stride_cache + d, mask=d < HALF, other=0.0)
    sin = tl.load(cache_ptr + pos * stride_cache + HALF + d, mask=d < HALF, other=0.0)
    _rotate_heads(q_ptr, stride_qn, stride_qh, token, num_q_heads, cos, sin, HALF, BLOCK_HQ, BLOCK_HALF)
    _rotate_heads(k_ptr, stride_kn, stride_kh, token, num_kv_heads, cos, sin, HALF, BLOCK_HK, BLOCK_HALF)


def apply_rotary(
    q: torch.Tensor,              # [N, Hq, D], rotated in place
    k: torch.Tensor,              # [N, Hkv, D], rotated in place
    positions: torch.Tensor,      # [N] int64
    cos_sin_cache: torch.Tensor,  # [max_positions, D] fp32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates q and k in place and returns them; callers use the return values."""
    num_tokens, num_q_heads, head_dim = q.shape
    if num_tokens == 0:
        return q, k
    if q.stride(-1) != 1 or k.stride(-1) != 1 or cos_sin_cache.stride(-1) != 1:
        raise ValueError("apply_rotary needs q, k and cos_sin_cache with a contiguous last dim")
    half = head_dim // 2
    _rotary_kernel[(num_tokens,)](
        q, k, positions, cos_sin_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
        num_q_heads, k.shape[1],
        HALF=half, BLOCK_HQ=triton.next_power_of_2(num_q_heads), BLOCK_HK=triton.next_power_of_2(k.shape[1]),
        BLOCK_HALF=triton.next_power_of_2(half), num_warps=4 if num_q_heads * head_dim >= 2048 else 2,
    )
    return q, k


def apply_rotary_ref(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference (and the CPU path): same in-place contract, math in fp32."""
    half = q.shape[-1] // 2
    cs = cos_sin_cache[positions.long()]          # [N, D]
    cos, sin = cs[:, None, :half], cs[:, None, half:]  # [N, 1, D/2]
    for x in (q, k):
        x1, x2 = x[..., :half].float(), x[..., half:].float()
        rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        x.copy_(rotated)
    return q, k
