"""Torch references for kernels whose engine path never runs them (the CPU path takes other
ops): only the tests compare against these. The references the engine or bench/ also call stay
beside their kernels in engine/kernels/."""
from __future__ import annotations

import torch

from engine.kernels.activation import silu_and_mul_ref
from engine.kernels.moe_align import align_sizes
from engine.kernels.rmsnorm import fused_add_rms_norm_ref, rms_norm_ref
from engine.kernels.rotary import apply_rotary_ref
from engine.kernels.skinny_gemm import skinny_linear_ref
from engine.kernels.store_kvcache import store_kvcache_ref
from engine.sampling_noise import uniform_noise


def gumbel_argmax_ref(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor,
                      positions: torch.Tensor) -> torch.Tensor:
    """Torch reference: the same formula over uniform_noise's [B, V] uniforms."""
    x = logits.float()
    t = temperature.float()[:, None]
    u = uniform_noise(seeds, positions, x.shape[-1])
    score = torch.where(t == 0, x, x / t - torch.log(-torch.log(u)))
    score = score.masked_fill(score.isnan(), float("-inf"))
    return score.argmax(dim=-1)


def moe_align_ref(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plain-torch reference with a loop over experts (host syncs)."""
    flat = topk_ids.reshape(-1).long()
    num_pairs = flat.numel()
    max_padded, num_blocks = align_sizes(num_pairs, num_experts, block_m)
    sorted_token_ids = torch.full((max_padded,), num_pairs, dtype=torch.int32)
    expert_ids = torch.full((num_blocks,), -1, dtype=torch.int32)
    pos = 0
    for e in range(num_experts):
        idx = torch.nonzero(flat.cpu() == e).flatten()
        if idx.numel() == 0:
            continue
        sorted_token_ids[pos:pos + idx.numel()] = idx.to(torch.int32)
        nblk = -(-idx.numel() // block_m)
        expert_ids[pos // block_m: pos // block_m + nblk] = e
        pos += nblk * block_m
    dev = topk_ids.device
    return sorted_token_ids.to(dev), expert_ids.to(dev), torch.tensor([pos], dtype=torch.int32, device=dev)


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


def rms_norm_linear_ref(x, weight, norm_weight, eps, residual=None, bias=None, sumsq=None,
                        gated=False):
    """Reference: the unfused torch ops (HF's norm, then the fp32 product, then HF's SwiGLU)."""
    if residual is None:
        h, residual_out = rms_norm_ref(x, norm_weight, eps, sumsq), x
    else:
        h, residual_out = fused_add_rms_norm_ref(x, residual, norm_weight, eps, sumsq)
    out = skinny_linear_ref(h, weight, bias)
    return (silu_and_mul_ref(out) if gated else out), residual_out
