"""Tensor-parallel rank/size of this process and the collectives the layers call.

With one rank every collective is a no-op, so the TP=1 path runs no communication code.
A per-step counter records how many collectives the forward issued (shown in the Engine tab).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

_rank = 0
_size = 1
_collectives = 0


def set_tp(rank: int, size: int) -> None:
    global _rank, _size
    _rank, _size = rank, size


def get_tp_rank() -> int:
    return _rank


def get_tp_size() -> int:
    return _size


def take_collective_count() -> int:
    global _collectives
    n, _collectives = _collectives, 0
    return n


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    global _collectives
    if _size > 1:
        dist.all_reduce(x)
        _collectives += 1
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate each rank's x along the last dim (vocab-parallel logits, head probes)."""
    global _collectives
    if _size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_size)]
    dist.all_gather(parts, x.contiguous())
    _collectives += 1
    return torch.cat(parts, dim=-1)


def all_gather_dim(x: torch.Tensor, dim: int) -> torch.Tensor:
    global _collectives
    if _size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_size)]
    dist.all_gather(parts, x.contiguous())
    _collectives += 1
    return torch.cat(parts, dim=dim)


def divide(a: int, b: int, what: str) -> int:
    if a % b:
        raise ValueError(f"{what}={a} is not divisible by tensor_parallel_size={b}; "
                         f"choose a tensor_parallel_size that divides {a}")
    return a // b
