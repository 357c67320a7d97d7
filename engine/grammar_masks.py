"""A step's token bitmasks for its guided rows (engine/guided.py), filled into reused host
buffers (pinned where a GPU is present: the copy is asynchronous, no page is pinned per step).

Under overlap scheduling a guided row's newest token is still on the device when the next step
is prepared. Instead of draining the pipeline, the mask is filled late: the runner launches the
next forward, then calls `LateMask`, which waits for the step in flight, advances the grammars
and fills the mask while that forward runs.
"""
from __future__ import annotations

import numpy as np
import torch


class GrammarMasks:
    def __init__(self, pin: bool | None = None):
        self.pin = torch.cuda.is_available() if pin is None else pin
        self._bufs: list[np.ndarray | None] = [None, None]     # uint32 views of _pinned
        self._pinned: list[torch.Tensor | None] = [None, None]
        self._turn = 0

    def fill(self, grammars: list, allowed: list | None = None) -> np.ndarray:
        """[rows, ceil(V/32)] int32 (a view of a buffer reused two steps later): bit t of row
        r set = token t allowed; rows whose grammar is None allow everything. `allowed`: per
        row None or a static bitmask (allowed_token_ids, engine/token_filters.py) ANDed in."""
        allowed = allowed or [None] * len(grammars)
        words = next((g.vocab_size + 31) // 32 for g in grammars if g is not None) \
            if any(g is not None for g in grammars) else \
            next(len(a) for a in allowed if a is not None)
        rows = len(grammars)
        # two buffers, alternating: a step's mask is read by its copy to the device, which has
        # happened before the step after next fills the same buffer (that one waits on it)
        self._turn ^= 1
        buf = self._bufs[self._turn]
        if buf is None or buf.shape[0] < rows or buf.shape[1] != words:
            t = torch.empty(max(rows, 8 if buf is None else 2 * buf.shape[0]), words,
                            dtype=torch.int32, pin_memory=self.pin)
            self._pinned[self._turn] = t        # keeps the pinned memory alive
            buf = self._bufs[self._turn] = t.numpy().view(np.uint32)
        for r, (g, a) in enumerate(zip(grammars, allowed)):
            if g is not None:
                g.fill(buf[r])
                if a is not None:
                    np.bitwise_and(buf[r], a, out=buf[r])
            elif a is not None:
                buf[r] = a
            else:
                buf[r].fill(0xFFFFFFFF)
        return buf[:rows].view(np.int32)


class LateMask:
    """The mask of a step prepared while the step before it runs (called by the runner after
    it has launched the forward; it blocks until that previous step is done)."""

    def __init__(self, masks: GrammarMasks, prev_out, poll, grammars: list,
                 advance: list[tuple[object, int, int]], allowed: list | None = None):
        self.masks, self.prev_out, self.poll = masks, prev_out, poll
        self.grammars, self.allowed = grammars, allowed
        self.advance = advance      # (grammar, output index, row in the previous step's sample)

    def __call__(self) -> np.ndarray:
        self.prev_out.wait(self.poll)
        toks = self.prev_out.sampled_host
        for g, index, row in self.advance:
            try:
                g.consume_at(index, int(toks[row]))
            except ValueError:      # refused: postprocess consumes again and fails the request
                pass
        return self.masks.fill(self.grammars, self.allowed)
