"""Parameters and bytes per part of the model, total and active per token, and what one
tensor-parallel rank holds of each. Shapes are the checkpoint's ([out, in]); the split rules
follow engine/layers/linear.py (column / row / QKV, KV heads replicated when tp > num_kv_heads),
embed_head.py (vocabulary padded to a multiple of tp) and moe.py (expert intermediate dims).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .architecture import Architecture

# split rules: (dim, rule) per tensor; None = replicated on every rank
EVEN, CEIL, KV = "even", "ceil", "kv"


@dataclass(frozen=True)
class WeightPart:
    key: str                                  # "embed_tokens", "layers.{L}.self_attn.q_proj", ...
    group: str                                # "embedding", "attention", "norms", "mlp", ...
    shapes: tuple[tuple[int, ...], ...]       # one instance: weight (and bias), checkpoint layout
    splits: tuple[tuple[int, str] | None, ...]  # per tensor: how tensor parallelism cuts it
    layers: tuple[int, ...] = ()              # layers holding it; () for a model-level part
    experts: int = 0                          # > 0: stacked over this many experts ...
    top_k: int = 0                            # ... of which top_k run per token
    tied_to: str | None = None                # shares its tensor with this part (no own params)

    @property
    def label(self) -> str:
        return self.key.replace("layers.{L}.", "").replace("self_attn.", "").replace("mlp.", "")

    @property
    def instances(self) -> int:
        return len(self.layers) or 1

    @property
    def params_one(self) -> int:
        """Parameters of one instance (one layer's copy)."""
        return sum(math.prod(s) for s in self.shapes)

    @property
    def params(self) -> int:
        return 0 if self.tied_to else self.instances * self.params_one

    @property
    def active_params(self) -> int:
        """Parameters one token's forward reads: top_k of the experts, all of anything else."""
        return self.params * self.top_k // self.experts if self.experts else self.params

    def params_per_rank(self, tp: int, num_kv_heads: int) -> int:
        """Parameters one rank holds at tensor-parallel degree tp (every rank holds the same
        amount: padded vocabulary rows and replicated KV heads included)."""
        if self.tied_to:
            return 0
        total = 0
        for shape, split in zip(self.shapes, self.splits):
            dims = list(shape)
            if split is not None:
                dim, rule = split
                n = dims[dim]
                if rule == EVEN:
                    dims[dim] = n // tp
                elif rule == CEIL:
                    dims[dim] = -(-n // tp)
                else:       # KV heads: split when there are enough, else one (replicated) per rank
                    dims[dim] = n // num_kv_heads * max(num_kv_heads // tp, 1)
            total += math.prod(dims)
        return self.instances * total


@dataclass
class WeightBreakdown:
    parts: list[WeightPart]
    dtype: str
    elem_bytes: int
    tied: bool
    num_kv_heads: int

    @property
    def total_params(self) -> int:
        return sum(p.params for p in self.parts)

    @property
    def active_params(self) -> int:
        return sum(p.active_params for p in self.parts)

    @property
    def total_bytes(self) -> int:
        return self.total_params * self.elem_bytes

    def by_group(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for p in self.parts:
            out[p.group] = out.get(p.group, 0) + p.params
        return out

    def params_per_rank(self, tp: int) -> int:
        return sum(p.params_per_rank(tp, self.num_kv_heads) for p in self.parts)


def _linear(key, group, out_f, in_f, bias, layers, column: bool, kv: bool = False):
    """A [out, in] projection; column-parallel splits out (and its bias), row-parallel in."""
    split = (0, KV if kv else EVEN) if column else (1, EVEN)
    shapes, splits = ((out_f, in_f),), (split,)
    if bias:        # a column-parallel bias is split like its rows, a row-parallel one is whole
        shapes, splits = shapes + ((out_f,),), splits + (split if column else None,)
    return WeightPart(key, group, shapes, splits, layers)


def weight_parts(a: Architecture) -> list[WeightPart]:
    """Every parameter tensor of the model, grouped into parts; layers sharing a part's shape
    are one part with their list."""
    h, d, v = a.hidden_size, a.head_dim, a.vocab_size
    every = tuple(range(a.num_layers))
    dense = tuple(i for i, k in enumerate(a.mlp_kinds) if k == "dense")
    sparse = tuple(i for i, k in enumerate(a.mlp_kinds) if k == "moe")
    q, kv = a.num_heads * d, a.num_kv_heads * d
    parts = [
        WeightPart("embed_tokens", "embedding", ((v, h),), ((0, CEIL),)),
        WeightPart("layers.{L}.input_layernorm", "norms", ((h,),), (None,), every),
        _linear("layers.{L}.self_attn.q_proj", "attention", q, h, a.qkv_bias, every, True),
        _linear("layers.{L}.self_attn.k_proj", "attention", kv, h, a.qkv_bias, every, True, True),
        _linear("layers.{L}.self_attn.v_proj", "attention", kv, h, a.qkv_bias, every, True, True),
    ]
    if a.qk_norm:
        parts += [WeightPart("layers.{L}.self_attn.q_norm", "norms", ((d,),), (None,), every),
                  WeightPart("layers.{L}.self_attn.k_norm", "norms", ((d,),), (None,), every)]
    parts += [_linear("layers.{L}.self_attn.o_proj", "attention", h, q, False, every, False),
              WeightPart("layers.{L}.post_attention_layernorm", "norms", ((h,),), (None,), every)]
    if dense:
        i = a.intermediate_size
        parts += [_linear("layers.{L}.mlp.gate_proj", "mlp", i, h, False, dense, True),
                  _linear("layers.{L}.mlp.up_proj", "mlp", i, h, False, dense, True),
                  _linear("layers.{L}.mlp.down_proj", "mlp", h, i, False, dense, False)]
    if sparse:
        e, k, m = a.num_experts, a.top_k, a.moe_intermediate_size
        parts += [
            WeightPart("layers.{L}.mlp.gate", "router", ((e, h),), (None,), sparse),
            WeightPart("layers.{L}.mlp.experts.gate_proj", "experts", ((e, m, h),), ((1, EVEN),),
                       sparse, e, k),
            WeightPart("layers.{L}.mlp.experts.up_proj", "experts", ((e, m, h),), ((1, EVEN),),
                       sparse, e, k),
            WeightPart("layers.{L}.mlp.experts.down_proj", "experts", ((e, h, m),), ((2, EVEN),),
                       sparse, e, k)]
        s = a.shared_expert_intermediate_size
        if s:
            parts += [
                _linear("layers.{L}.mlp.shared_expert.gate_proj", "shared expert", s, h, False,
                        sparse, True),
                _linear("layers.{L}.mlp.shared_expert.up_proj", "shared expert", s, h, False,
                        sparse, True),
                _linear("layers.{L}.mlp.shared_expert.down_proj", "shared expert", h, s, False,
                        sparse, False),
                WeightPart("layers.{L}.mlp.shared_expert_gate", "shared gate", ((1, h),), (None,),
                           sparse)]
    parts += [WeightPart("norm", "final norm", ((h,),), (None,)),
              WeightPart("lm_head", "lm head", ((v, h),), ((0, CEIL),),
                         tied_to="embed_tokens" if a.tied else None)]
    return parts


def weight_breakdown(a: Architecture, elem_bytes: int, dtype: str) -> WeightBreakdown:
    return WeightBreakdown(weight_parts(a), dtype, elem_bytes, a.tied, a.num_kv_heads)
