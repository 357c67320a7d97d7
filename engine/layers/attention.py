"""Paged attention: store this step's K/V through slot_mapping, then attend over the paged
cache through block tables. Decode steps use the split-KV decode kernel; anything with a
multi-token chunk (prefill, chunked prefill, prefix hits, mixed batches) uses the varlen one.
On the GPU, `forward_qkv` takes the fused projection output and applies q/k norm and RoPE and
stores K/V in one launch (instead of four)."""
from __future__ import annotations

import torch
from torch import nn

from ..context import get_context
from ..kernel_config import DEFAULT_KERNELS, KernelConfig
from ..kernels import (cascade_attention, decode_attention, prefill_attention, qk_norm_rope_store,
                       store_kvcache)


class Attention(nn.Module):
    def __init__(self, layer_idx: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 scale: float, kernels: KernelConfig = DEFAULT_KERNELS):
        super().__init__()
        self.layer_idx = layer_idx
        self.kernels = kernels    # the engine's kernel choices (PDL)
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.k_cache = self.v_cache = torch.empty(0)   # bound by the model runner

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [N, Hq, D], k/v [N, Hkv, D] -> [N, Hq, D]: store K/V, then attend."""
        ctx = get_context()
        (store_kvcache.store_kvcache if q.is_cuda else store_kvcache.store_kvcache_cpu)(
            k, v, self.k_cache, self.v_cache, ctx.slot_mapping)
        return self.attend(q, ctx)

    def forward_qkv(self, qkv: torch.Tensor, positions: torch.Tensor,
                    cos_sin_cache: torch.Tensor, q_norm_weight: torch.Tensor | None,
                    k_norm_weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        """qkv [N, (Hq + 2 Hkv) D] straight from the projection -> [N, Hq, D]. One launch
        applies the q/k norm (when given) and RoPE and stores K/V; the GPU path."""
        ctx = get_context()
        # a watched query's row is written by the same launch into the probe's buffer
        rows = ctx.probes.q_row_out(self.layer_idx, self.num_heads, self.head_dim, qkv.dtype,
                                    qkv.device) if ctx.probes is not None else None
        q = qk_norm_rope_store.qk_norm_rope_store(
            qkv, positions, cos_sin_cache, self.k_cache, self.v_cache, ctx.slot_mapping,
            self.num_heads, self.num_kv_heads, q_norm_weight, k_norm_weight, eps,
            probe_rows=rows[0] if rows else None, probe_q=rows[1] if rows else None,
            pdl=self.kernels.pdl)
        return self.attend(q, ctx, q_written=rows is not None)

    def attend(self, q: torch.Tensor, ctx, q_written: bool = False) -> torch.Tensor:
        """q [N, Hq, D] over the paged cache, which already holds this step's K/V."""
        cuda = q.is_cuda
        if ctx.probes is not None:
            ctx.probes.on_attention(self.layer_idx, q, self.k_cache, ctx, q_written)
        if ctx.is_decode and ctx.cascade is not None:    # rows sharing prefix blocks
            c = ctx.cascade
            if cuda:
                o = cascade_attention.cascade_decode_attention(
                    q, self.k_cache, self.v_cache, ctx.block_tables, ctx.context_lens, self.scale,
                    c, max_context=ctx.max_context_len, pdl=self.kernels.pdl)
            else:
                o = cascade_attention.cascade_decode_attention_ref(
                    q, self.k_cache, self.v_cache, ctx.block_tables, ctx.context_lens, self.scale,
                    c.first, int(c.lead[0]))
        elif ctx.is_decode:
            if cuda:
                o = decode_attention.paged_decode_attention(
                    q, self.k_cache, self.v_cache, ctx.block_tables, ctx.context_lens, self.scale,
                    max_context=ctx.max_context_len, pdl=self.kernels.pdl)
            else:
                o = decode_attention.paged_decode_attention_cpu(
                    q, self.k_cache, self.v_cache, ctx.block_tables, ctx.context_lens, self.scale)
        elif cuda:
            o = prefill_attention.paged_prefill_attention(
                q, self.k_cache, self.v_cache, ctx.cu_seqlens_q, ctx.context_lens,
                ctx.block_tables, self.scale, ctx.max_seqlen_q, pdl=self.kernels.pdl)
        else:
            o = prefill_attention.paged_prefill_attention_ref(
                q, self.k_cache, self.v_cache, ctx.cu_seqlens_q, ctx.context_lens,
                ctx.block_tables, self.scale, ctx.max_seqlen_q)
        if ctx.interventions is not None:   # clamped heads: recomputed over their chosen keys
            o = ctx.interventions.clamp(self.layer_idx, q, o, self.k_cache, self.v_cache, ctx,
                                        self.scale)
        return o
