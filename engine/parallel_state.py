"""Tensor-parallel group of this rank: its rank, size and the collectives the layers call.

A TPGroup is captured by each layer when it is built (not read from a global at run time),
so two engines with different groups can live in one process. With one rank every
collective is a no-op and no communication code runs. The group counts its collectives
per step (shown in the Engine tab).
"""
from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field

import torch


class CollectiveTimer:
    """Measured time spent in one step's collectives: CUDA event pairs around each one on a GPU
    (read after the step is done), host wall time on the CPU (gloo collectives are synchronous).
    Measured, not counted: it includes waiting for the slowest rank."""

    def __init__(self, cuda: bool, external: bool = False):
        self.cuda, self.external = cuda, external
        self.pairs: list[tuple] = []
        self.host_s = 0.0

    @contextlib.contextmanager
    def around(self):
        if self.cuda:
            start = torch.cuda.Event(enable_timing=True, external=self.external)
            end = torch.cuda.Event(enable_timing=True, external=self.external)
            start.record()
            yield
            end.record()
            self.pairs.append((start, end))
        else:
            t0 = time.perf_counter()
            yield
            self.host_s += time.perf_counter() - t0

    def total(self) -> float | None:
        """Seconds (call once the step's device work is done)."""
        try:
            return self.host_s + sum(s.elapsed_time(e) for s, e in self.pairs) / 1e3
        except RuntimeError:        # events that were never completed: no measurement
            return None


@dataclass
class TPGroup:
    rank: int = 0
    size: int = 1
    group: object = None        # a torch ProcessGroup (gloo or NCCL), None for one rank
    collectives: int = 0
    device_type: str = "cpu"
    timer: CollectiveTimer | None = field(default=None, repr=False)

    def _timed(self):
        return self.timer.around() if self.timer is not None else contextlib.nullcontext()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            with self._timed():
                self.group.allreduce([x]).wait()
            self.collectives += 1
        return x

    def all_gather_dim(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Concatenate every rank's x along dim (vocab-parallel logits, per-head probes)."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        with self._timed():
            self.group.allgather([parts], [x]).wait()
        self.collectives += 1
        return torch.cat(parts, dim=dim)

    def start_step(self) -> CollectiveTimer | None:
        """A fresh timer for this step's eager collectives (None with one rank)."""
        self.timer = CollectiveTimer(self.device_type == "cuda") if self.size > 1 else None
        return self.timer

    def take_collective_count(self) -> int:
        n, self.collectives = self.collectives, 0
        self.timer = None
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
