"""SnapshotBuffers: the per-block arrays of a snapshot copied into buffers already touched.

Why: a snapshot copies two per-block arrays (ref counts, int32, and cached-hash flags) — 320 KB
at 65k blocks. A fresh numpy array that size is a fresh mapping from the allocator, and its
first write faults every page in: on the GPU host (a sandboxed kernel, where a fault is
expensive) a reader's copy of an idle engine took 0.76 ms of CPU under the engine lock for what
is a 20 µs memcpy. Copies land here in a buffer that no snapshot references any more (its
reference count says so: a view or slice of it counts too), so its pages are mapped already.

A buffer is reused only when nothing outside this pool holds it or a view of it, so an array
handed out in a snapshot never changes afterwards. Bounded: past `per_shape` buffers a copy is
a plain allocation.
"""
from __future__ import annotations

import sys

import numpy as np



def _own_refs() -> int:
    """What sys.getrefcount reports for a pooled buffer nobody else holds, seen the way
    SnapshotBuffers.copy sees it (the list, the loop variable, the call's argument: 3 on
    CPython 3.11/3.12). Measured, not assumed: an interpreter that counts fewer (borrowed stack
    references) must not take a held buffer for a free one."""
    pool = [np.empty(1)]
    for buf in pool:
        return sys.getrefcount(buf)
    return 0


_OURS = _own_refs()


class SnapshotBuffers:
    def __init__(self, per_shape: int = 8):
        self.per_shape = per_shape
        self._pools: dict[tuple, list[np.ndarray]] = {}
        self.reused = 0             # copies into a buffer already touched (diagnostics, tests)
        self.allocated = 0

    def copy(self, src: np.ndarray) -> np.ndarray:
        """A copy of `src` that nobody else holds, in a reused buffer where one is free.
        Call with the engine lock held (the pool is the engine thread's and readers' copy
        path, both under the lock)."""
        pool = self._pools.setdefault((src.shape, src.dtype.str), [])
        for buf in pool:
            if sys.getrefcount(buf) == _OURS:
                np.copyto(buf, src)
                self.reused += 1
                return buf
        out = src.copy()
        self.allocated += 1
        if len(pool) < self.per_shape:
            pool.append(out)
        return out
