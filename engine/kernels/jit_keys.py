"""Which kernel arguments Triton must not specialize on.

Triton compiles a kernel once per key, which includes for every integer argument whether it is
1 or a multiple of 16, and for every pointer whether it is 16-byte aligned. Eager kernels take
counts and staging-buffer slices that change every step, so each new combination compiled
inside a serving run (10 compiles, 4.8 s at Qwen3-30B-A3B on an H200: bench/RESULTS.md,
"The first-run dip found"). The arguments named here feed scalar loads, masks and address
arithmetic, where the hint buys nothing.
"""
from __future__ import annotations


def varying(*names: str) -> tuple[str, ...]:
    """`@triton.jit(do_not_specialize=varying(...))`: the per-step arguments of an eager kernel."""
    return names
