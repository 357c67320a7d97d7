"""RMSNorm with an optional fused residual add (Triton on GPU, the torch reference on CPU).

With a residual, returns (normed, residual_out) where residual_out = x + residual is the true
residual stream. `sumsq` (probes only) receives sum(residual^2) per row, computed by the same
kernel: residual norms for the probes cost no extra launch.
"""
from __future__ import annotations

import torch
from torch import nn

from ..kernel_config import DEFAULT_KERNELS, KernelConfig
from ..kernels import rmsnorm as k


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6, kernels: KernelConfig = DEFAULT_KERNELS):
        super().__init__()
        self.eps = eps
        self.kernels = kernels    # the engine's kernel choices (PDL)
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                sumsq: torch.Tensor | None = None):
        if not x.is_cuda:
            if residual is None:
                return k.rms_norm_ref(x, self.weight, self.eps, sumsq)
            return k.fused_add_rms_norm_ref(x, residual, self.weight, self.eps, sumsq)
        if residual is None:
            return k.rms_norm(x, self.weight, self.eps, sumsq, self.kernels.pdl)
        return k.fused_add_rms_norm(x, residual, self.weight, self.eps, sumsq, self.kernels.pdl)
