"""The per-step cascade decision: do enough rows of a decode batch share prefix blocks that
reading those once (kernels/cascade_attention.py) beats reading them once per row?

From the block tables (prefix caching makes a shared prefix the same physical blocks): the
largest set of rows whose tables start with the same block, and the run of blocks they all
share from there, counting only full blocks before every row's newest token (written by this
step). It pays when the reads saved outweigh one more launch per layer: (rows - 1) x shared
tokens at least KernelConfig.cascade_min_saved_tokens (0: never).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class CascadePlan:
    first: np.ndarray       # [B] int32: each row's first key past the shared prefix (0: none)
    lead: int               # a row of the group
    rows: int               # rows in the group
    shared_tokens: int      # tokens of the shared prefix (whole blocks)

    @property
    def saved_tokens(self) -> int:
        """Token reads per KV head and layer the cascade saves (the prefix once, not per row)."""
        return (self.rows - 1) * self.shared_tokens


def plan_cascade(block_tables: np.ndarray, context_lens: np.ndarray, block_size: int,
                 min_saved: int) -> CascadePlan | None:
    """The step's cascade, or None when it would not pay (see the module docstring)."""
    B = len(context_lens)
    if B < 2 or min_saved <= 0 or block_tables.shape[1] == 0:
        return None
    heads = block_tables[:, 0]
    live = context_lens > block_size          # a full first block before the newest token
    if not live.any():
        return None
    values, counts = np.unique(heads[live], return_counts=True)
    if counts.max() < 2:
        return None
    lead_block = values[counts.argmax()]
    rows = np.flatnonzero(live & (heads == lead_block))
    group = block_tables[rows]
    # blocks every row of the group holds in the same place, from the first on
    same = (group == group[0]).all(axis=0)
    run = int(same.argmin()) if not same.all() else len(same)
    # full blocks before every row's newest token: (context - 1) // block_size of them
    run = min(run, int((context_lens[rows] - 1).min()) // block_size)
    shared = run * block_size
    if run == 0 or (len(rows) - 1) * shared < min_saved:
        return None
    first = np.zeros(B, dtype=np.int32)
    first[rows] = shared
    return CascadePlan(first, int(rows[0]), len(rows), shared)
