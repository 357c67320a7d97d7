"""Architecture: a model's dimensions and structure in one record, read from the built model
(what the engine really runs) or, for published checkpoints, from a config by the same rules
the model classes in engine/models/ follow."""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

from ..models.qwen import head_dim_of
from ..models.qwen_moe import is_moe_layer


@dataclass(frozen=True)
class Architecture:
    name: str
    architecture: str               # config.architectures[0]
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int                  # query heads
    num_kv_heads: int
    head_dim: int
    intermediate_size: int          # dense MLP width (layers whose kind is "dense")
    qkv_bias: bool                  # Qwen2: q/k/v carry a bias
    qk_norm: bool                   # Qwen3: RMSNorm on each q and k head
    tied: bool                      # the LM head is the embedding matrix
    mlp_kinds: tuple[str, ...]      # per layer: "dense" or "moe"
    num_experts: int = 0
    top_k: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0   # Qwen2-MoE: one always-on expert with a gate
    norm_topk_prob: bool = False

    @property
    def is_moe(self) -> bool:
        return "moe" in self.mlp_kinds

    @property
    def gqa_group(self) -> int:
        """Query heads that share one KV head."""
        return self.num_heads // self.num_kv_heads

    def as_config(self) -> SimpleNamespace:
        """The config attributes engine/tp_layout.rank_layout reads."""
        return SimpleNamespace(
            num_attention_heads=self.num_heads, num_key_value_heads=self.num_kv_heads,
            intermediate_size=self.intermediate_size, num_experts=self.num_experts,
            moe_intermediate_size=self.moe_intermediate_size, vocab_size=self.vocab_size)


def _dims(cfg, name: str, moe: bool) -> dict:
    moe = (getattr(cfg, "num_experts", 0) or 0) if moe else 0
    return dict(
        name=name, architecture=cfg.architectures[0], vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size, num_layers=cfg.num_hidden_layers,
        num_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_key_value_heads,
        head_dim=head_dim_of(cfg), intermediate_size=getattr(cfg, "intermediate_size", 0) or 0,
        num_experts=moe, top_k=(getattr(cfg, "num_experts_per_tok", 0) or 0) if moe else 0,
        moe_intermediate_size=(getattr(cfg, "moe_intermediate_size", 0) or 0) if moe else 0,
        norm_topk_prob=bool(getattr(cfg, "norm_topk_prob", False)) if moe else False)


def architecture_of_model(model, hf_config, name: str) -> Architecture:
    """Structure from the built modules (rank 0 with TP), full sizes from the config: a rank
    holds slices, the config says what the slices add up to."""
    layers = model.model.layers
    attn = layers[0].self_attn
    kinds = tuple("moe" if hasattr(layer.mlp, "experts") else "dense" for layer in layers)
    shared = 0
    for layer in layers:
        if getattr(layer.mlp, "shared_expert", None) is not None:
            shared = hf_config.shared_expert_intermediate_size
    return Architecture(
        **_dims(hf_config, name, "moe" in kinds), qkv_bias=attn.qkv_proj.bias is not None,
        qk_norm=bool(attn.qk_norm),
        tied=model.lm_head.weight is model.model.embed_tokens.weight, mlp_kinds=kinds,
        shared_expert_intermediate_size=shared)


def architecture_of_config(config, name: str) -> Architecture:
    """From a config object or a plain dict (published checkpoints), by the rules of
    engine/models/qwen.py (bias, q/k norm) and qwen_moe.py (which layers are sparse)."""
    cfg = SimpleNamespace(**config) if isinstance(config, dict) else config
    arch = cfg.architectures[0]
    qwen3 = "Qwen3" in arch
    moe = "Moe" in arch and (getattr(cfg, "num_experts", 0) or 0) > 0
    kinds = tuple("moe" if moe and is_moe_layer(cfg, i) else "dense"
                  for i in range(cfg.num_hidden_layers))
    return Architecture(
        **_dims(cfg, name, moe),
        qkv_bias=bool(getattr(cfg, "attention_bias", False)) if qwen3 else True, qk_norm=qwen3,
        tied=bool(getattr(cfg, "tie_word_embeddings", False)), mlp_kinds=kinds,
        shared_expert_intermediate_size=(getattr(cfg, "shared_expert_intermediate_size", 0)
                                         or 0) if moe else 0)
