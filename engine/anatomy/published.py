"""Reference data, not the loaded model: the shapes of published Qwen checkpoints, copied from
their config.json files on the Hugging Face hub (Qwen/<name>), with the sizes their model
cards state. Parameter counts are computed from these configs by the same code that counts
the loaded model; tests check they round to the cards' numbers."""
from __future__ import annotations

from dataclasses import dataclass

from .architecture import Architecture, architecture_of_config
from .tensor_parallel import tp_plan
from .weights import weight_breakdown

_QWEN3 = dict(vocab_size=151936, head_dim=128, attention_bias=False)
_QWEN25 = dict(vocab_size=152064, architectures=["Qwen2ForCausalLM"], tie_word_embeddings=False)


def _dense3(layers, hidden, inter, heads, kv, tied):
    return dict(_QWEN3, architectures=["Qwen3ForCausalLM"], num_hidden_layers=layers,
                hidden_size=hidden, intermediate_size=inter, num_attention_heads=heads,
                num_key_value_heads=kv, tie_word_embeddings=tied)


def _moe3(layers, hidden, inter, heads, kv, experts, top_k, moe_inter):
    return dict(_QWEN3, architectures=["Qwen3MoeForCausalLM"], num_hidden_layers=layers,
                hidden_size=hidden, intermediate_size=inter, num_attention_heads=heads,
                num_key_value_heads=kv, num_experts=experts, num_experts_per_tok=top_k,
                moe_intermediate_size=moe_inter, norm_topk_prob=True, decoder_sparse_step=1,
                mlp_only_layers=[], tie_word_embeddings=False)


def _dense25(layers, hidden, inter, heads, kv):
    return dict(_QWEN25, num_hidden_layers=layers, hidden_size=hidden, intermediate_size=inter,
                num_attention_heads=heads, num_key_value_heads=kv)


# name -> (config, the model card's total, its active-per-token or None for dense)
PUBLISHED: dict[str, tuple[dict, str, str | None]] = {
    "Qwen3-0.6B": (_dense3(28, 1024, 3072, 16, 8, True), "0.6B", None),
    "Qwen3-1.7B": (_dense3(28, 2048, 6144, 16, 8, True), "1.7B", None),
    "Qwen3-4B": (_dense3(36, 2560, 9728, 32, 8, True), "4.0B", None),
    "Qwen3-8B": (_dense3(36, 4096, 12288, 32, 8, False), "8.2B", None),
    "Qwen3-14B": (_dense3(40, 5120, 17408, 40, 8, False), "14.8B", None),
    "Qwen3-32B": (_dense3(64, 5120, 25600, 64, 8, False), "32.8B", None),
    "Qwen3-30B-A3B": (_moe3(48, 2048, 6144, 32, 4, 128, 8, 768), "30.5B", "3.3B"),
    "Qwen3-235B-A22B": (_moe3(94, 4096, 12288, 64, 4, 128, 8, 1536), "235B", "22B"),
    "Qwen2.5-7B": (_dense25(28, 3584, 18944, 28, 4), "7.61B", None),
    "Qwen2.5-72B": (_dense25(80, 8192, 29568, 64, 8), "72.7B", None),
}
SOURCE = ("published configs: config.json of Qwen/<name> on the Hugging Face hub; "
          "card sizes from the model cards")


@dataclass(frozen=True)
class ShapeRow:
    name: str
    arch: Architecture
    total_params: int
    active_params: int
    card_total: str | None          # the model card's number; None for the loaded model
    card_active: str | None
    min_tp_h200: int | None         # smallest TP in 1/2/4/8 whose bf16 weights fit an H200
    loaded: bool = False


def shape_row(name: str, arch: Architecture, card_total=None, card_active=None,
              loaded: bool = False) -> ShapeRow:
    w = weight_breakdown(arch, 2, "bfloat16")
    min_tp = next((tp for tp in (1, 2, 4, 8) if tp_plan(arch, w, tp).fits), None)
    return ShapeRow(name, arch, w.total_params, w.active_params, card_total, card_active,
                    min_tp, loaded)


def published_rows() -> list[ShapeRow]:
    return [shape_row(name, architecture_of_config(cfg, name), total, active)
            for name, (cfg, total, active) in PUBLISHED.items()]
