"""Which kernel arguments Triton must not specialize on.

Triton compiles a kernel once per *key*, and the key includes, for every integer argument, whether
it is 1 or a multiple of 16, and for every pointer whether it is 16-byte aligned. The kernels of
eager steps (prefill attention, sampling, MoE alignment and grouped GEMMs) take counts that change
every step (pairs, splits, block-table width) and int32/int64 vectors sliced from the step's
staging buffer at offsets that depend on the batch. Each new combination compiled inside a
serving run: 5 compiles, 1.8 s in the first 256-request run of Qwen3-0.6B and 10, 4.8 s at
Qwen3-30B-A3B on an H200 (bench/RESULTS.md, 2026-12-03 fifth session, "The first-run dip found") —
the "first run of every process is slower" dip; with these keys none, and batch-1 decode the same
as with Triton's default keys. Arguments named here are left unspecialized: they feed scalar
loads, masks along non-contiguous axes and address arithmetic, where the hint buys nothing.
"""
from __future__ import annotations


def varying(*names: str) -> tuple[str, ...]:
    """`@triton.jit(do_not_specialize=varying(...))`: the per-step arguments of an eager kernel."""
    return names
