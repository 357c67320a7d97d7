"""Tensor-parallel group of this rank: its rank, size and the collectives the layers call.

A TPGroup is captured by each layer when it is built (not read from a global at run time),
so two engines with different groups can live in one process. With one rank every
collective is a no-op and no communication code runs. The group counts its collectives
per step (shown in the Engine tab).
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass

import torch


@dataclass
class TPGroup:
    rank: int = 0
    size: int = 1
    group: object = None        # a torch ProcessGroup (gloo or NCCL), None for one rank
    collectives: int = 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            self.group.allreduce([x]).wait()
            self.collectives += 1
        return x

    def all_gather_dim(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Concatenate every rank's x along dim (vocab-parallel logits, per-head probes)."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.group.allgather([parts], [x]).wait()
        self.collectives += 1
        return torch.cat(parts, dim=dim)

    def take_collective_count(self) -> int:
        n, self.collectives = self.collectives, 0
        return n


# per thread: layers read the group while they are built, and two engines may be built at
# once in one process (on two threads)
_local = threading.local()


def get_tp() -> TPGroup:
    g = getattr(_local, "group", None)
    return g if g is not None else TPGroup()


def get_tp_rank() -> int:
    return get_tp().rank


def get_tp_size() -> int:
    return get_tp().size


@contextlib.contextmanager
def use_tp(group: TPGroup):
    """Build layers inside this block (on this thread) to bind them to `group`."""
    prev = getattr(_local, "group", None)
    _local.group = group
    try:
        yield group
    finally:
        _local.group = prev


def divide(a: int, b: int, what: str) -> int:
    if a % b:
        raise ValueError(f"{what}={a} is not divisible by tensor_parallel_size={b}; "
                         f"choose a tensor_parallel_size that divides {a}")
    return a // b
