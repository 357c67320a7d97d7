"""Attention clamped to chosen key positions (Intervention.clamp_attention). A clamped head
attends only to its few chosen keys, so its output is recomputed here from those keys alone
(gathered through the block table) and written over the paged kernel's output for its rows;
every other row keeps the kernel's bits. Fixed shapes and no host sync, so a decode CUDA graph
can capture it.
"""
from __future__ import annotations

import torch


def token_seq_and_pos(ctx, num_tokens: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence index [N], absolute position [N]) of each flat token of the step, from the
    forward context: a decode step has one token per sequence, at context_len - 1; a chunk of
    q_len tokens ends at its sequence's context_len."""
    tokens = torch.arange(num_tokens, device=device)
    ctx_lens = ctx.context_lens.long()
    if ctx.is_decode:
        return tokens, ctx_lens[:num_tokens] - 1
    cu = ctx.cu_seqlens_q.long()
    seq = torch.searchsorted(cu[1:], tokens, right=True)
    return seq, ctx_lens[seq] - (cu[seq + 1] - tokens)


def _per_query_head(kv: torch.Tensor, num_q_heads: int) -> torch.Tensor:
    """[n, P, Hkv, D] -> [n, P, Hq, D], query head h reading KV head h // group (GQA), by
    expand + reshape: repeat_interleave may sync with the host, which a graph capture refuses."""
    n, p, hkv, d = kv.shape
    return kv[:, :, :, None, :].expand(n, p, hkv, num_q_heads // hkv, d).reshape(n, p, num_q_heads, d)


def clamped_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      block_tables: torch.Tensor, seq: torch.Tensor, pos: torch.Tensor,
                      keys: torch.Tensor, scale: float) -> torch.Tensor:
    """q [n, Hq, D] over only the keys at positions `keys` [n, P] (int64, -1 = none) of each
    row's sequence `seq` [n] that it may see (position <= pos [n]). Softmax over those keys,
    in fp32; a row that sees none of them gets zeros. Caches [blocks, page, Hkv, D]."""
    num_blocks, page = k_cache.shape[0], k_cache.shape[1]
    visible = (keys >= 0) & (keys <= pos[:, None])                     # [n, P]
    at = keys.clamp(min=0)
    col = (at // page).clamp(max=block_tables.shape[1] - 1)
    blocks = block_tables.long()[seq[:, None], col].clamp(0, num_blocks - 1)   # [n, P]
    slot = at % page
    k = _per_query_head(k_cache[blocks, slot].float(), q.shape[1])     # [n, P, Hq, D]
    # a key it may not see could sit in a slot holding anything: keep it out of the product
    v = torch.where(visible[:, :, None, None], v_cache[blocks, slot].float(), 0.0)
    v = _per_query_head(v, q.shape[1])
    scores = torch.einsum("nhd,nphd->nhp", q.float(), k) * scale       # [n, Hq, P]
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    probs = torch.where(visible.any(-1)[:, None, None], probs, 0.0)   # no key: NaN -> 0
    return torch.einsum("nhp,nphd->nhd", probs, v).to(q.dtype)        # [n, Hq, D]
