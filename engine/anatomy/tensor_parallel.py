"""What each tensor-parallel rank holds and where the ranks talk, at the running degree and
"what if" at another: query and KV heads, MLP and expert slices, vocabulary rows
(engine/tp_layout.rank_layout), parameters and bytes per rank, the collectives of a
forward (read from the modules' code), and whether the weights fit one GPU."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..parallel_state import divide
from ..records import RankLayout
from ..tp_layout import rank_layout
from .architecture import Architecture
from .runtime_code import collective_of
from .weights import WeightBreakdown

H200_BYTES = 141 * 10**9          # one H200's HBM (the machine this project's GPU runs use)
GPU_UTILISATION = 0.9             # the engine's default gpu_memory_utilization


@dataclass(frozen=True)
class CollectivePoint:
    where: str                  # "layers.{L}.self_attn.o_proj"
    symbol: str                 # the module class that issues it
    op: str                     # "all_reduce" or "all_gather"
    layers: tuple[int, ...]     # layers where it happens; () for a model-level one

    @property
    def count(self) -> int:
        return len(self.layers) or 1


def collective_points(model) -> list[CollectivePoint]:
    """Every collective one forward issues at TP > 1, from the modules whose forward calls one.
    A module that reduces its output also sums everything inside it (an MoE block reduces its
    experts and shared expert at once), so its children are not counted again."""
    found: dict[tuple[str, str, str], list[int]] = {}
    reducing: list[str] = []
    for name, m in model.named_modules():
        op = collective_of(type(m))
        if op is None or any(name.startswith(r + ".") for r in reducing):
            continue
        reducing.append(name)
        parts = name.split(".")
        layer = None
        if len(parts) > 2 and parts[:2] == ["model", "layers"]:
            layer, parts = int(parts[2]), ["layers", "{L}"] + parts[3:]
        elif parts[0] == "model":
            parts = parts[1:]
        key = (".".join(parts), type(m).__name__, op)
        found.setdefault(key, [])
        if layer is not None:
            found[key].append(layer)
    return [CollectivePoint(w, s, op, tuple(layers)) for (w, s, op), layers in found.items()]


@dataclass
class RankShare:
    layout: RankLayout          # heads, MLP / expert slice, vocabulary rows, KV cache bytes
    params: int                 # parameters this rank holds
    weight_bytes: int


@dataclass
class TPPlan:
    tp: int
    possible: bool
    reason: str                             # why not, when not possible
    ranks: list[RankShare] = field(default_factory=list)
    q_heads_per_rank: int = 0
    kv_heads_per_rank: int = 0
    kv_replicas: int = 1                    # ranks holding a copy of each KV head
    kv_bytes_per_token: int = 0             # per rank, all layers, K and V
    collectives: list[CollectivePoint] = field(default_factory=list)
    gpu_bytes: int = H200_BYTES
    utilisation: float = GPU_UTILISATION

    @property
    def collectives_per_forward(self) -> int:
        return sum(c.count for c in self.collectives) if self.tp > 1 else 0

    @property
    def weight_bytes_per_rank(self) -> int:
        return max((r.weight_bytes for r in self.ranks), default=0)

    @property
    def budget_bytes(self) -> int:
        return int(self.gpu_bytes * self.utilisation)

    @property
    def fits(self) -> bool:
        """Do one rank's weights fit its GPU's budget (KV cache, activations aside)?"""
        return self.possible and self.weight_bytes_per_rank <= self.budget_bytes

    @property
    def kv_tokens_that_fit(self) -> int:
        """Tokens of KV cache the budget holds after the weights (on each rank)."""
        if not self.fits or not self.kv_bytes_per_token:
            return 0
        return (self.budget_bytes - self.weight_bytes_per_rank) // self.kv_bytes_per_token


def check_tp(a: Architecture, tp: int) -> str:
    """'' when the layers can be split tp ways, else the reason (from the layers' own check)."""
    try:
        if tp < 1:
            raise ValueError(f"tensor_parallel_size must be at least 1, got {tp}")
        divide(a.num_heads, tp, "num_attention_heads")
        if a.num_kv_heads >= tp:
            divide(a.num_kv_heads, tp, "num_key_value_heads")
        else:
            divide(tp, a.num_kv_heads, "tensor_parallel_size vs num_key_value_heads")
        if "dense" in a.mlp_kinds:
            divide(a.intermediate_size, tp, "intermediate_size")
        if a.is_moe:
            divide(a.moe_intermediate_size, tp, "moe_intermediate_size")
        if a.shared_expert_intermediate_size:
            divide(a.shared_expert_intermediate_size, tp, "shared_expert_intermediate_size")
    except ValueError as e:
        return str(e)
    return ""


def tp_plan(a: Architecture, weights: WeightBreakdown, tp: int, *, elem_bytes: int | None = None,
            kv_tokens: int = 0, collectives: list[CollectivePoint] | None = None,
            gpu_bytes: int = H200_BYTES, utilisation: float = GPU_UTILISATION) -> TPPlan:
    """The split at degree tp. elem_bytes: bytes per weight and KV element (default: as
    loaded); kv_tokens: KV cache size in tokens, for each rank's cache bytes."""
    elem = elem_bytes or weights.elem_bytes
    reason = check_tp(a, tp)
    plan = TPPlan(tp, not reason, reason, collectives=list(collectives or []),
                  gpu_bytes=gpu_bytes, utilisation=utilisation)
    if reason:
        return plan
    plan.q_heads_per_rank = a.num_heads // tp
    plan.kv_heads_per_rank = max(a.num_kv_heads // tp, 1)
    plan.kv_replicas = max(tp // a.num_kv_heads, 1)
    plan.kv_bytes_per_token = 2 * a.num_layers * plan.kv_heads_per_rank * a.head_dim * elem
    params = weights.params_per_rank(tp)
    cfg = a.as_config()
    plan.ranks = [RankShare(rank_layout(cfg, r, tp, kv_tokens * plan.kv_bytes_per_token),
                            params, params * elem) for r in range(tp)]
    return plan
