"""The matrix product behind every linear layer: cuBLAS, or our skinny Triton GEMM for
decode-sized batches on the GPU.

At M = 1 cuBLAS streams a Qwen3-0.6B projection at 0.7-3 TB/s (its split-K variants add a
reduce kernel); the skinny kernel reaches 2-4.4 TB/s, which cut the GEMM time of a batch-1
decode step from ~943 to ~546 us on an H200 (`python bench/diagnostics/skinny_gemm.py`). From
M = 2 to 8 it wins only on narrow outputs (o_proj, down_proj, N <= 2048) and on the LM head;
elsewhere cuBLAS's tensor-core tiles are as fast or faster, so those stay with F.linear.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

SKINNY_MAX_M = 8
LM_HEAD_N = 32768        # vocabulary-sized outputs


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           after_attention: bool = False, pdl: bool = True) -> torch.Tensor:
    """after_attention: the projection of decode attention's output (o_proj), whose one-row GEMV
    requests its whole weight tile before the PDL wait (skinny_gemm.whole_tile_config). pdl: the
    skinny GEMM launches with PDL where the GPU has it (KernelConfig.pdl)."""
    m, n = x.shape[0], weight.shape[0]
    if (x.is_cuda and x.dim() == 2 and x.dtype == weight.dtype and 0 < m
            and (m == 1 or (m <= SKINNY_MAX_M and (n <= 2048 or n >= LM_HEAD_N)))):
        from ..kernels import skinny_gemm as sg
        config = None
        if after_attention and x.shape[0] == 1:
            config = sg.whole_tile_config(weight.shape[0], weight.shape[1], x.element_size())
        return sg.skinny_linear(x, weight, bias, config=config, pdl=pdl)
    return F.linear(x, weight, bias)
