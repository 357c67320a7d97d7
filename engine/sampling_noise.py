"""uniform_noise: the sampler's randomness as a pure function of (seed, position, token id).

A counter-based hash (splitmix64), not a generator: a request's draws do not depend on what
else is in the batch, and the fused Triton sampler (kernels/sampling_kernel.py) recomputes the
very same numbers on the device. Both the torch sampler and that kernel import it from here.
"""
from __future__ import annotations

import torch


def _as_signed(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


_C0, _C1, _C2 = (_as_signed(0x9E3779B97F4A7C15), _as_signed(0xBF58476D1CE4E5B9),
                 _as_signed(0x94D049BB133111EB))


def _mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64 finaliser on int64 (wrapping multiply; logical shifts emulated by masks)."""
    x = x ^ ((x >> 30) & ((1 << 34) - 1))
    x = x * _C1
    x = x ^ ((x >> 27) & ((1 << 37) - 1))
    x = x * _C2
    return x ^ ((x >> 31) & ((1 << 33) - 1))


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, vocab] uniforms in (0, 1), a pure function of (seed, position, token id)."""
    key = _mix64(seeds.to(torch.int64) * _C0 + positions.to(torch.int64))          # [B]
    ids = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    bits = _mix64(key[:, None] + ids[None, :] * _C0)                               # [B, V]
    # 23 bits: (2**23 - 1) + 0.5 is exact in fp32, so u < 1 strictly. With 24 bits it rounded
    # to 2**24, u == 1.0, E = -log u = 0: that token won whatever its probability (~1 draw in
    # 111 at a 152k vocabulary).
    return (((bits >> 41) & ((1 << 23) - 1)).float() + 0.5) * (1.0 / (1 << 23))
