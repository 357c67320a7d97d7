"""Programmatic dependent launch (PDL, Hopper and later) for the kernels of a decode step.

A batch-1 decode step is ~265 small kernels in a row, each spending much of its 2-4 us ramping
up and draining. A kernel launched with `launch_pdl=True` may start while the one before it
finishes; `griddepcontrol.wait` inside it blocks until that kernel has finished and its writes
are visible. So before the wait a kernel may only read what no earlier kernel writes (the skinny
GEMM loads its first chunk of weights there) and must store nothing.

Every kernel here calls `griddepcontrol.launch_dependents` right after its wait: at most two
kernels overlap, and ordering stays transitive. Kernels launched without the attribute (torch
ops, cuBLAS, MoE kernels) wait for their predecessor in full. Each launcher takes `pdl`
(KernelConfig.pdl: off for debugging); the interpreter and pre-Hopper GPUs never use it.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


@functools.lru_cache(maxsize=None)
def _capable(device_index: int) -> bool:
    # NVIDIA sm_90+ only: ROCm reports its own (gfx) numbers here and has no griddepcontrol
    return torch.version.hip is None and torch.cuda.get_device_capability(device_index)[0] >= 9


def use_pdl(t: torch.Tensor, enabled: bool = True) -> bool:
    """Launch this call's kernels with PDL? (`enabled`, a CUDA tensor, sm_90+)"""
    if not (enabled and t.is_cuda):
        return False
    index = t.device.index if t.device.index is not None else torch.cuda.current_device()
    return _capable(index)


@triton.jit
def wait_prior(USE_PDL: tl.constexpr):
    """Block until the previous kernel in the stream has finished (a no-op without PDL), then let
    the next one launch."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
