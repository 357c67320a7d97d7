"""ProbeResult: what one step's probes hand to the host, queued when the step is launched and
read when it is postprocessed. Small results cross in one non-blocking copy into pinned memory
of their own; attention rows stay on the device in copies of their own. Nothing points into a
CUDA graph's static buffers, which the next replay overwrites.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class QueuedAttention:
    """One watched query's attention rows, copied out of the step's buffers (device)."""
    entry_index: int            # index in the plan's entries
    position: int               # query position
    layers: list[int]
    probs: torch.Tensor         # [len(layers), Hq, position + 1] fp32
    block_table: list[int]      # physical blocks of the context at this step


@dataclass
class ProbeResult:
    layout: dict[str, tuple[int, tuple]]        # name -> (offset, shape) in `flat`
    flat: torch.Tensor | None                   # pinned host (GPU) or host tensor, fp32
    attention: list[QueuedAttention] = field(default_factory=list)
    has_shared_gate: bool = False

    @classmethod
    def start(cls, named: list[tuple[str, torch.Tensor]], packed_layout: dict,
              attention: list[QueuedAttention], has_shared_gate: bool) -> "ProbeResult":
        layout, off, parts = {}, 0, []
        for name, t in named:
            if name == "packed":            # already flat: keep its own layout, shifted
                for k, (o, shape) in packed_layout.items():
                    layout[k] = (off + o, shape)
            else:
                layout[name] = (off, tuple(t.shape))
            parts.append(t.reshape(-1).float())
            off += t.numel()
        flat = None
        if parts:
            dev = torch.cat(parts) if len(parts) > 1 else parts[0]
            if dev.is_cuda:     # the caching host allocator reuses a block only once its copy is done
                flat = torch.empty(dev.numel(), dtype=torch.float32, pin_memory=True)
                flat.copy_(dev, non_blocking=True)
            else:
                flat = dev.clone() if len(parts) == 1 else dev
        return cls(layout, flat, attention, has_shared_gate)

    def host(self) -> dict[str, np.ndarray]:
        """Every small result as numpy (only after the step's wait())."""
        if self.flat is None:
            return {}
        flat = self.flat.numpy()
        return {name: flat[off:off + math.prod(shape)].reshape(shape)
                for name, (off, shape) in self.layout.items()}


def queue_attention_rows(bufs, plan, block_size: int) -> list[QueuedAttention]:
    """Device copies of the attention rows each watched sampling entry of `plan` asked for."""
    a = bufs.attn_probs                             # [A, W, Hq, max_ctx] or None
    if a is None or not plan.attention_layers:
        return []
    out, w = [], 0
    for i, e in enumerate(plan.entries):
        if not e.records_last:
            continue
        if e.spec.attention:
            layers = [l for l in plan.attention_layers
                      if e.spec.layers is None or l in e.spec.layers]
            slots = [bufs.attn_slot[l] for l in layers]
            for j in range(e.num_sampled):      # a verify: one query per sampled row
                pos = e.start_pos + e.num_tokens - e.num_sampled + j
                if slots == list(range(a.shape[0])):
                    rows = a[:, w + j, :, :pos + 1].clone()        # [layers, Hq, pos + 1]
                else:
                    rows = a[slots, w + j, :, :pos + 1]            # advanced indexing: a copy
                out.append(QueuedAttention(i, pos, layers, rows,
                                           e.block_table[:pos // block_size + 1]))
        w += e.num_sampled
    return out
