"""RMSNorm folded into the linear layer that reads its output (batch-1 decode on the GPU).

At batch 1 a decode layer's two norms are ~2 us kernels that each wait for the kernel before
and hold up the one after; folded into the skinny GEMM (engine/kernels/skinny_prologue.py) the
normed row never goes through memory and the chain is two launches shorter per layer. The fold
is `factored` (the 1/rms scale applied to the product, one pass over x): Qwen3-0.6B batch-1
decode on an H200 went 1,223 -> 1,238 tok/s (HF's rounding points, `prepass`: 1,196). SiLU *
up is folded into gate_up's epilogue (`gated`): 1,258 -> 1,310 tok/s (bench/RESULTS.md,
2026-12-03). Everywhere else (the CPU, prefill, batches > 1) these are the unfused calls.
"""
from __future__ import annotations

import torch

from .activation import silu_and_mul
from .linear import LinearBase
from .norm import RMSNorm


def norm_linear(norm: RMSNorm, layer: LinearBase, x: torch.Tensor,
                residual: torch.Tensor | None, sumsq: torch.Tensor | None = None,
                gated: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(layer(norm(x + residual)), x + residual); residual None means x is the residual (the
    embedding entering layer 0). `layer` must need no communication on its input side
    (replicated or column-parallel), as qkv_proj and gate_up_proj are. gated: `layer` is the
    merged gate_up projection and the first value is silu_and_mul of its output."""
    # one row on the GPU, in the weights' dtype: the skinny GEMM's batch-1 case
    if x.is_cuda and x.dim() == 2 and x.shape[0] == 1 and x.dtype == layer.weight.dtype:
        from ..kernels.skinny_gemm import rms_norm_linear
        swiglu = gated and layer.bias is None
        pdl = layer.kernels.pdl
        out, residual = rms_norm_linear(x, layer.weight, norm.weight, norm.eps, residual, layer.bias,
                                        sumsq, factored=True, gated=swiglu, pdl=pdl)
        return (silu_and_mul(out, pdl) if gated and not swiglu else out), residual
    if residual is None:
        out, residual = layer(norm(x, sumsq=sumsq)), x
    else:
        h, residual = norm(x, residual, sumsq)
        out = layer(h)
    return (silu_and_mul(out, layer.kernels.pdl) if gated else out), residual
