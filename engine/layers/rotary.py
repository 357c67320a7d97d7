"""Rotary position embedding (NeoX layout, as HF Qwen) with a precomputed cos/sin table."""
from __future__ import annotations

import torch
from torch import nn

from ..kernels import rotary as k


def rope_theta(config) -> float:
    """rope_theta from either config layout: top level, or inside rope_parameters/rope_scaling."""
    for holder in ("rope_parameters", "rope_scaling"):
        d = getattr(config, holder, None)
        if isinstance(d, dict) and "rope_theta" in d:
            return float(d["rope_theta"])
    theta = getattr(config, "rope_theta", None)
    return float(theta) if theta is not None else 10000.0


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, base: float):
        super().__init__()
        self.register_buffer("cos_sin_cache",
                             k.build_cos_sin_cache(head_dim, max_positions, base, "cpu"),
                             persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k_: torch.Tensor):
        """q [N, Hq, D], k [N, Hkv, D] -> rotated (q, k)."""
        fn = k.apply_rotary if q.is_cuda else k.apply_rotary_ref
        return fn(q, k_, positions, self.cos_sin_cache)
