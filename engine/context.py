"""Forward metadata for one step, set by the model runner and read by attention and probes.

Model code then reads `forward(input_ids, positions)` and stays close to the math.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import torch


@dataclass
class ForwardContext:
    slot_mapping: torch.Tensor          # [num_tokens] int32/int64: cache slot per token, -1 = pad
    context_lens: torch.Tensor          # [num_seqs] int32: KV length incl. this step's tokens
    block_tables: torch.Tensor          # [num_seqs, max_blocks] int32
    cu_seqlens_q: torch.Tensor | None   # [num_seqs + 1] int32 (None in pure decode)
    max_seqlen_q: int
    is_decode: bool                     # every sequence has exactly one new token
    probes: object | None = None        # ProbeBuffers of this step, or None (probes off)
    interventions: object | None = None  # InterventionBuffers of this step, or None (none)
    max_context_len: int | None = None  # decode graphs: a bound on every context_lens value, which
    #                                    sizes decode attention's splits (None: the table's width)
    cascade: object | None = None       # kernels.cascade_attention.CascadeInputs: shared prefix


# per thread: each engine runs its forward on its own loop thread, and two engines may live in
# one process (two UI models, two TP engines), so a process-wide global would be shared by both
_local = threading.local()


def set_context(ctx: ForwardContext | None) -> None:
    _local.ctx = ctx


def get_context() -> ForwardContext:
    ctx = getattr(_local, "ctx", None)
    assert ctx is not None, "no forward context: call through ModelRunner"
    return ctx
