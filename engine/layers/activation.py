"""SiLU-and-mul: the gated activation of Qwen's MLP (Triton on GPU, torch on CPU)."""
from __future__ import annotations

import torch

from ..kernels import activation as k


def silu_and_mul(x: torch.Tensor, pdl: bool = True) -> torch.Tensor:
    """[N, 2I] -> [N, I]; pdl: the GPU kernel launches with PDL where it can (KernelConfig.pdl)"""
    return k.silu_and_mul(x, pdl) if x.is_cuda else k.silu_and_mul_ref(x)
