"""Sparse MoE experts (Qwen2-MoE / Qwen3-MoE): router -> top-k -> fused experts.

Expert weights are stacked as w13 [E, 2I, H] (gate rows, then up rows) and w2 [E, H, I]; with
TP each rank holds every expert's slice of the intermediate dim, and the partial outputs are
joined by one all-reduce. The router is replicated. Routing is reported to the probes.
"""
from __future__ import annotations

import torch
from torch import nn

from ..context import get_context
from ..kernel_config import DEFAULT_KERNELS, KernelConfig
from ..kernels import fused_moe as fm
from ..kernels import moe_configs, moe_cpu, moe_routing
from ..kernels.moe_gemv import fused_moe_gemv
from ..parallel_state import divide, get_tp_rank, get_tp_size
from .gemm import linear
from .linear import copy_checked, expect_size, materialize, narrow


class FusedMoE(nn.Module):
    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 norm_topk_prob: bool, kernels: KernelConfig = DEFAULT_KERNELS):
        super().__init__()
        self.kernels = kernels    # PDL, the tuned tables' directory
        tp = get_tp_size()
        self.num_experts, self.top_k, self.norm_topk_prob = num_experts, top_k, norm_topk_prob
        self.inter = divide(intermediate_size, tp, "moe_intermediate_size")
        self.rank, self.tp_size = get_tp_rank(), tp
        self.route_counts: torch.Tensor | None = None  # the fused router's semaphores (GPU)
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * self.inter, hidden_size),
                                requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, self.inter),
                               requires_grad=False)
        self.w13.weight_loader = self.weight_loader
        self.w2.weight_loader = self.weight_loader
        # every (expert, piece) must be loaded once: per-expert tensors, or one fused tensor
        self.w13.shard_keys = {(e, p) for e in range(num_experts) for p in (0, 1)}
        self.w2.shard_keys = {(e, 2) for e in range(num_experts)}

    def weight_loader(self, param, loaded, shard) -> None:
        """shard = (expert, piece): piece 0 gate, 1 up, 2 down; expert None = all experts
        at once from the fused 3-D layout (gate_up_proj [E, 2I, H] / down_proj [E, H, I])."""
        expert, piece = shard
        i, r, full = self.inter, self.rank, self.inter * self.tp_size
        if expert is None:
            w = materialize(loaded)
            if piece == 2:
                copy_checked(param, narrow(w, 2, r * i, i, full=full))
            else:   # fused gate_up: gate rows [0, I_full), up rows [I_full, 2 I_full)
                expect_size(w, 1, 2 * full)
                copy_checked(param.data[:, :i], w.narrow(1, r * i, i))
                copy_checked(param.data[:, i:], w.narrow(1, full + r * i, i))
            return {k for k in param.shard_keys if (k[1] == 2) == (piece == 2)}
        if piece == 2:
            copy_checked(param.data[expert], materialize(narrow(loaded, 1, r * i, i, full=full)))
        else:
            copy_checked(param.data[expert, piece * i:(piece + 1) * i],
                         materialize(narrow(loaded, 0, r * i, i, full=full)))

    def forward(self, x: torch.Tensor, gate_weight: torch.Tensor, layer_idx: int,
                shared_gate: torch.Tensor | None = None) -> torch.Tensor:
        """x [N, H], gate_weight [E, H] (the replicated router) -> partial (un-reduced) output [N, H]."""
        out, bias = self._route_args(layer_idx, x.shape[0])
        return _experts(self, x, *self.route(x, gate_weight, out, bias), layer_idx, shared_gate)

    def can_fold_norm(self, hidden: torch.Tensor) -> bool:
        """May the post-attention norm run inside the router's launch (forward_norm)? Decode
        batches on the GPU, where the fused router runs. (One H200, Qwen3-30B-A3B batch-1 decode:
        381.4 -> 387.5 tok/s; bench/RESULTS.md, 2026-12-03 fifth session.)"""
        return self._fused_router(hidden)

    def forward_norm(self, hidden: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
                     eps: float, gate_weight: torch.Tensor, layer_idx: int):
        """fused_add_rms_norm(hidden, residual) then forward, with the norm inside the router's
        launch: -> (partial output [N, H], residual stream). Only where can_fold_norm."""
        out, bias = self._route_args(layer_idx, hidden.shape[0])
        probs, topk_w, topk_ids, x, residual = moe_routing.norm_route_hidden(
            hidden, residual, norm_weight, eps, gate_weight, self.top_k, self.norm_topk_prob,
            self.route_counts, out, bias=bias, pdl=self.kernels.pdl)
        return _experts(self, x, probs, topk_w, topk_ids, layer_idx, None), residual

    def _route_args(self, layer_idx: int, n: int):
        ctx = get_context()
        probes = ctx.probes
        out = probes.route_out(layer_idx, n) if probes is not None else None
        # interventions: masked experts' logits -inf (bias [N, E] of 0 / -inf), else None
        bias = ctx.interventions.router_bias(layer_idx) if ctx.interventions is not None else None
        return out, bias

    def _fused_router(self, x: torch.Tensor) -> bool:
        """Does x's batch take the one-launch router (route_hidden)? Its semaphores are
        allocated on the first call outside a CUDA-graph capture."""
        if not (x.is_cuda and 0 < x.shape[0] <= moe_routing.FUSED_MAX_TOKENS and x.dim() == 2
                and x.stride(1) == 1):
            return False
        if self.route_counts is None and not torch.cuda.is_current_stream_capturing():
            self.route_counts = moe_routing.route_counts(x.device)  # before any capture
        return self.route_counts is not None

    def route(self, x: torch.Tensor, gate_weight: torch.Tensor, out=None, bias=None):
        """Router logits -> (probs [N, E] fp32, topk weights [N, k] fp32, topk ids [N, k] int32).
        Decode batches on the GPU: one launch for the router GEMV and the routing; else the router
        linear (skinny GEMM or cuBLAS), then the routing kernel (route_ref on the CPU: HF's ops)."""
        if self._fused_router(x):
            return moe_routing.route_hidden(x, gate_weight, self.top_k, self.norm_topk_prob,
                                            self.route_counts, out, bias=bias,
                                            pdl=self.kernels.pdl)
        logits = linear(x, gate_weight, pdl=self.kernels.pdl)
        if bias is not None:        # + 0 leaves a logit as it is; + -inf masks the expert
            logits = logits + bias
        return moe_routing.route(logits, self.top_k, self.norm_topk_prob, out)


def _experts(moe: FusedMoE, x, probs, topk_w, topk_ids, layer_idx, shared_gate):
    """Report the routing to the probes, then run the experts (a function, not a method: the
    Anatomy page follows a forward's calls by name to find the kernels it reaches)."""
    probes = get_context().probes
    if probes is not None:
        probes.on_router(layer_idx, probs, topk_ids, topk_w, shared_gate)
    if x.is_cuda:   # the kernels round the fp32 weights to x.dtype themselves: no cast launch
        return fused_experts(x, moe.w13, moe.w2, topk_w, topk_ids, kernels=moe.kernels)
    # each token's output independent of the step's other tokens (moe_cpu.py says why)
    return moe_cpu.fused_moe_cpu(x, moe.w13, moe.w2, topk_w, topk_ids)


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, config: moe_configs.MoEConfig | None = None,
                  kernels: KernelConfig = DEFAULT_KERNELS) -> torch.Tensor:
    """x [N, H], w13 [E, 2I, H], w2 [E, H, I], topk_* [N, k] -> [N, H], by the path the config
    names: decode-sized batches the GEMV path (only the active experts' weights read), larger
    ones the grouped GEMM; unless given, the config tuned for (E, I, H, dtype, device) at the
    nearest tuned N (kernels.moe_config_dir, else engine/kernels/configs/). The choice depends
    only on shapes, so a CUDA graph captures one path per batch bucket."""
    if config is None:
        config = moe_configs.pick_config(x.shape[0], topk_ids.shape[1], w13.shape[0], w2.shape[2],
                                         x.shape[1], x.dtype, x.device, kernels.moe_config_dir)
    if config.path == "gemv":
        return fused_moe_gemv(x, w13, w2, topk_weights, topk_ids, config=config, pdl=kernels.pdl)
    return fm.fused_moe(x, w13, w2, topk_weights, topk_ids, config=config)
