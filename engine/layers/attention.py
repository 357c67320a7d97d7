"""Paged attention: store this step's K/V through slot_mapping, then attend over the paged
cache through block tables. Decode steps use the split-KV decode kernel; anything with a
multi-token chunk (prefill, chunked prefill, prefix hits, mixed batches) uses the varlen one."""
from __future__ import annotations

import torch
from torch import nn

from ..context import get_context
from ..kernels import decode_attention, prefill_attention, store_kvcache


class Attention(nn.Module):
    def __init__(self, layer_idx: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 scale: float):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.k_cache = self.v_cache = torch.empty(0)   # bound by the model runner

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [N, Hq, D], k/v [N, Hkv, D] -> [N, Hq, D]"""
        ctx = get_context()
        cuda = q.is_cuda
        (store_kvcache.store_kvcache if cuda else store_kvcache.store_kvcache_cpu)(
            k, v, self.k_cache, self.v_cache, ctx.slot_mapping)
        if ctx.probes is not None:
            ctx.probes.on_attention(self.layer_idx, q, self.k_cache, ctx)
        if ctx.is_decode:
            fn = (decode_attention.paged_decode_attention if cuda
                  else decode_attention.paged_decode_attention_cpu)
            return fn(q, self.k_cache, self.v_cache, ctx.block_tables, ctx.context_lens,
                      self.scale)
        fn = (prefill_attention.paged_prefill_attention if cuda
              else prefill_attention.paged_prefill_attention_ref)
        return fn(q, self.k_cache, self.v_cache, ctx.cu_seqlens_q, ctx.context_lens,
                  ctx.block_tables, self.scale, ctx.max_seqlen_q)
