"""The path of one token through the model, stage by stage, with the shape it has at each one
(per token: batch and sequence dimensions left out)."""
from __future__ import annotations

from dataclasses import dataclass, field

from .architecture import Architecture


@dataclass(frozen=True)
class PathStage:
    key: str                    # shared with runtime_code.CodeRef.key where a module runs it
    label: str
    shape: tuple[int, ...]      # of one token's tensor after this stage
    dims: tuple[str, ...]       # what each dimension is
    note: str = ""

    @property
    def shape_text(self) -> str:
        if not self.shape:
            return "scalar"
        return "[" + " × ".join(f"{n} {d}" if d else str(n)
                                for n, d in zip(self.shape, self.dims)) + "]"


@dataclass
class TokenPath:
    outer: list[PathStage]
    attention: list[PathStage]
    mlp: list[PathStage]                    # dense layers ([] when every layer is MoE)
    moe: list[PathStage]                    # MoE layers ([] for a dense model)
    gqa: list[list[int]] = field(default_factory=list)   # KV head j -> its query heads
    dense_layers: list[int] = field(default_factory=list)
    moe_layers: list[int] = field(default_factory=list)


def token_path(a: Architecture) -> TokenPath:
    h, v, d, L = a.hidden_size, a.vocab_size, a.head_dim, a.num_layers
    hq, hkv, g = a.num_heads, a.num_kv_heads, a.gqa_group
    head = ("embed_tokens [vocab × hidden] reused as the LM head (tied)" if a.tied
            else f"lm_head [{v} × {h}]")
    outer = [
        PathStage("token", "token id", (), (), f"an integer in [0, {v})"),
        PathStage("embed", "embedding row", (h,), ("hidden",),
                  f"row `id` of embed_tokens [{v} × {h}]"),
        PathStage("layers", f"{L} decoder layers", (h,), ("hidden",),
                  "each layer maps [hidden] to [hidden] and adds its result to the residual "
                  "stream: the same shape in and out, which is why layers stack"),
        PathStage("final_norm", "final RMSNorm", (h,), ("hidden",)),
        PathStage("lm_head", "LM head: logits", (v,), ("vocab",), f"hidden · {head}"),
        PathStage("sample", "sampling", (), (), "the next token id"),
    ]
    qk = [PathStage("qk_norm", "q/k RMSNorm", (hq, d), ("heads", "head_dim"),
                    f"each q and k head normalised over its {d} dims")] if a.qk_norm else []
    attention = [
        PathStage("input_norm", "RMSNorm", (h,), ("hidden",)),
        PathStage("qkv_proj", "q, k, v projection", ((hq + 2 * hkv) * d,), ("",),
                  f"[{h}] · [{h} × ({hq} + 2·{hkv}) · {d}]"
                  + (" + bias" if a.qkv_bias else "")),
        PathStage("q", "query heads", (hq, d), ("heads", "head_dim"),
                  f"hidden {h} split into {hq} heads × {d}"),
        PathStage("kv", "key and value heads", (2, hkv, d), ("k|v", "KV heads", "head_dim"),
                  f"{hkv} KV heads: each serves {g} query heads (GQA)" if g > 1
                  else "one KV head per query head (MHA)"),
        *qk,
        PathStage("rotary", "rotary position embedding", (hq, d), ("heads", "head_dim"),
                  "q and k rotated by the token's position"),
        PathStage("attention", "paged attention", (hq, d), ("heads", "head_dim"),
                  f"k, v stored in the token's KV-cache slot; query head i reads KV head "
                  f"i // {g} over the whole context: softmax(q·Kᵀ / √{d}) · V"),
        PathStage("concat", "heads concatenated", (hq * d,), ("",), f"{hq} × {d}"),
        PathStage("o_proj", "o_proj back to hidden", (h,), ("hidden",),
                  "added to the residual stream"),
    ]
    mlp, moe = [], []
    if "dense" in a.mlp_kinds:
        i = a.intermediate_size
        mlp = [PathStage("post_norm", "RMSNorm", (h,), ("hidden",)),
               PathStage("gate_up_proj", "gate and up projections", (2, i),
                         ("gate|up", "intermediate")),
               PathStage("act", "SiLU(gate) × up", (i,), ("intermediate",)),
               PathStage("down_proj", "down projection", (h,), ("hidden",),
                         "added to the residual stream")]
    if a.is_moe:
        e, k, m = a.num_experts, a.top_k, a.moe_intermediate_size
        s = a.shared_expert_intermediate_size
        renorm = ", renormalised to sum 1" if a.norm_topk_prob else ""
        moe = [PathStage("post_norm", "RMSNorm", (h,), ("hidden",)),
               PathStage("router", "router logits → softmax", (e,), ("experts",)),
               PathStage("topk", f"top-{k} of {e} experts", (k,), ("chosen",),
                         f"ids and their probabilities{renorm}"),
               PathStage("experts", "each chosen expert's MLP", (k, m), ("chosen", "intermediate"),
                         f"[{h}] → [2 × {m}] → SiLU·mul → [{m}] → [{h}]")]
        if s:
            moe.append(PathStage("shared_expert", "shared expert (always on)", (s,),
                                 ("intermediate",), "its output scaled by sigmoid(gate · x)"))
        moe.append(PathStage("moe_block", "weighted sum of the experts", (h,), ("hidden",),
                             "Σ weightᵢ · expertᵢ(x)" + (" + gate · shared(x)" if s else "")
                             + ", added to the residual stream"))
    return TokenPath(outer, attention, mlp, moe,
                     gqa=[list(range(j * g, (j + 1) * g)) for j in range(hkv)],
                     dense_layers=[i for i, t in enumerate(a.mlp_kinds) if t == "dense"],
                     moe_layers=[i for i, t in enumerate(a.mlp_kinds) if t == "moe"])
