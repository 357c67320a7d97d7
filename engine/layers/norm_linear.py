"""RMSNorm folded into the linear layer that reads its output (batch-1 decode on the GPU).

At batch 1 a decode layer's two norms are ~2 us kernels that each wait for the kernel before
and hold up the one after; folded into the skinny GEMM (engine/kernels/skinny_prologue.py) the
normed row never goes through memory and the chain is two launches shorter per layer.
Everywhere else (the CPU, prefill, batches > 1) these are the unfused modules' calls.

`GLASSBOX_FUSE_NORM` picks the fold: `factored` (the default: the 1/rms scale applied to the
product, one pass over x), `prepass` (HF's rounding points: a pass for the sum of squares
first), or `0` (off). One H200, Qwen3-0.6B batch-1 decode under PDL, two alternating rounds
(bench/results/2026-12-03b-fusion-ab.txt): off 1,223 / 1,221 tok/s, factored 1,238 / 1,239,
prepass 1,196 / 1,196. SiLU * up folded into down_proj the same way measured slower
(1,209 / 1,206) and was not kept.
"""
from __future__ import annotations

import os

import torch

from .linear import LinearBase
from .norm import RMSNorm

FUSE_NORM = os.environ.get("GLASSBOX_FUSE_NORM", "factored")
if FUSE_NORM not in ("0", "prepass", "factored"):
    raise ValueError(f"GLASSBOX_FUSE_NORM must be 0, prepass or factored, not {FUSE_NORM!r}")


def fuses(x: torch.Tensor, layer: LinearBase, enabled: bool = True) -> bool:
    """One row on the GPU, in the weights' dtype: the skinny GEMM's batch-1 case."""
    return (enabled and x.is_cuda and x.dim() == 2 and x.shape[0] == 1
            and x.dtype == layer.weight.dtype)


def norm_linear(norm: RMSNorm, layer: LinearBase, x: torch.Tensor,
                residual: torch.Tensor | None, sumsq: torch.Tensor | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(layer(norm(x + residual)), x + residual); residual None means x is the residual (the
    embedding entering layer 0). `layer` must need no communication on its input side
    (replicated or column-parallel), as qkv_proj and gate_up_proj are."""
    if fuses(x, layer, FUSE_NORM != "0"):
        from ..kernels.skinny_gemm import rms_norm_linear
        return rms_norm_linear(x, layer.weight, norm.weight, norm.eps, residual, layer.bias, sumsq,
                               factored=FUSE_NORM == "factored")
    if residual is None:
        return layer(norm(x, sumsq=sumsq)), x
    h, residual = norm(x, residual, sumsq)
    return layer(h), residual

