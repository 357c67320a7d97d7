"""Which heads, MLP slice, expert slice and vocabulary slice each tensor-parallel rank holds."""
from __future__ import annotations

from .records import RankLayout


def rank_layout(cfg, rank: int, tp: int, kv_bytes: int) -> RankLayout:
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    q_per = hq // tp
    if hkv >= tp:
        kv_per = hkv // tp
        kv_heads = list(range(rank * kv_per, (rank + 1) * kv_per))
    else:
        kv_heads = [rank * hkv // tp]
    inter = getattr(cfg, "intermediate_size", None)
    mlp = (rank * inter // tp, (rank + 1) * inter // tp) if inter else None
    moe_inter = getattr(cfg, "moe_intermediate_size", None) \
        if getattr(cfg, "num_experts", 0) else None
    experts = (rank * moe_inter // tp, (rank + 1) * moe_inter // tp) if moe_inter else None
    per_vocab = (cfg.vocab_size + tp - 1) // tp
    vocab = (rank * per_vocab, min((rank + 1) * per_vocab, cfg.vocab_size))
    return RankLayout(rank, list(range(rank * q_per, (rank + 1) * q_per)), kv_heads, mlp,
                      experts, vocab, kv_bytes)
