"""Qwen2-MoE (shared expert with a sigmoid gate) and Qwen3-MoE (no shared expert) on the dense
Qwen trunk: only the MLP changes. Layers listed in mlp_only_layers, or skipped by
decoder_sparse_step, keep a dense MLP."""
from __future__ import annotations

import re

import torch
from torch import nn

from ..kernel_config import DEFAULT_KERNELS, KernelConfig
from ..layers.linear import ReplicatedLinear
from ..layers.moe import FusedMoE
from ..parallel_state import get_tp
from .qwen import QwenForCausalLM, QwenMLP


def is_moe_layer(config, i: int) -> bool:
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return (i not in (getattr(config, "mlp_only_layers", None) or [])
            and config.num_experts > 0 and (i + 1) % step == 0)


class QwenSparseMoeBlock(nn.Module):
    def __init__(self, config, layer_idx: int, kernels: KernelConfig = DEFAULT_KERNELS):
        super().__init__()
        self.layer_idx = layer_idx
        self.tp = get_tp()
        self.gate = ReplicatedLinear(config.hidden_size, config.num_experts, kernels=kernels)
        self.experts = FusedMoE(config.num_experts, config.num_experts_per_tok,
                                config.hidden_size, config.moe_intermediate_size,
                                bool(getattr(config, "norm_topk_prob", False)), kernels)
        shared = getattr(config, "shared_expert_intermediate_size", 0) or 0
        self.shared_expert = self.shared_expert_gate = None
        if shared:
            self.shared_expert = QwenSharedExpert(config.hidden_size, shared, kernels)
            self.shared_expert_gate = ReplicatedLinear(config.hidden_size, 1, kernels=kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = None
        if self.shared_expert is not None:
            gate = torch.sigmoid(self.shared_expert_gate(x))           # [N, 1]
        out = self.experts(x, self.gate.weight, self.layer_idx, gate)  # routes with the gate's weight
        if self.shared_expert is not None:
            out = out + gate * self.shared_expert(x)                   # partial sums per rank
        return self.tp.all_reduce(out)

    def forward_norm(self, hidden: torch.Tensor, residual: torch.Tensor, norm) -> tuple:
        """The post-attention norm (`norm`, an RMSNorm) then the block: -> (output, residual
        stream). Decode batches on the GPU without a shared expert run the norm inside the
        router's launch (one launch a layer fewer); the rest norm first."""
        if (self.shared_expert is None and residual is not None and residual.stride(-1) == 1
                and residual.shape == hidden.shape and self.experts.can_fold_norm(hidden)):
            out, residual = self.experts.forward_norm(hidden, residual, norm.weight, norm.eps,
                                                      self.gate.weight, self.layer_idx)
            return self.tp.all_reduce(out), residual
        x, residual = norm(hidden, residual)
        return self.forward(x), residual


class QwenSharedExpert(QwenMLP):
    """The shared expert's down projection is summed in the MoE block's one all-reduce."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from ..layers.activation import silu_and_mul
        return torch.nn.functional.linear(silu_and_mul(self.gate_up_proj(x), self.kernels.pdl),
                                          self.down_proj.weight)


_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_FUSED = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")
_PIECE = {"gate_proj": 0, "up_proj": 1, "down_proj": 2}


class QwenMoeForCausalLM(QwenForCausalLM):
    @staticmethod
    def make_mlp(config, i: int, kernels: KernelConfig = DEFAULT_KERNELS) -> nn.Module:
        if is_moe_layer(config, i):
            return QwenSparseMoeBlock(config, i, kernels)
        return QwenForCausalLM.make_mlp(config, i, kernels)

    def __init__(self, config, max_positions: int, kernels: KernelConfig = DEFAULT_KERNELS):
        super().__init__(config, max_positions, kernels)
        self.moe_layers = [i for i in range(config.num_hidden_layers) if is_moe_layer(config, i)]

    def map_checkpoint_name(self, name: str):
        """Per-expert tensors and the fused 3-D layout -> (w13 | w2, (expert, piece))."""
        m = _EXPERT.match(name)
        if m:
            piece = _PIECE[m.group(3)]
            return f"{m.group(1)}.{'w2' if piece == 2 else 'w13'}", (int(m.group(2)), piece)
        m = _FUSED.match(name)
        if m:
            return (f"{m.group(1)}.w13", (None, "fused13")) if m.group(2) == "gate_up_proj" \
                else (f"{m.group(1)}.w2", (None, 2))
        return None
