"""StepEvents: the CUDA events a launched step records (timing start / end, and done), from a
ring made once, recorded on a stream looked up by device index.

Why: a host-bound batch-1 decode step spent ~0.1 ms of its ~1.1 ms host time on three events —
creating three torch.cuda.Event objects, and `Event.record()` with no stream asking
`torch.cuda.current_stream()` each time, whose device lookup (`_get_device_index(None)`)
walks torch's CUDA-availability checks in Python (bench/results/2026-12-02b-guided-profile-*:
768 records, 20 ms cumulative in current_stream over 256 steps).

Reuse is safe: a triple comes back only after its last step's `done` has completed (a cheap
`query()`; the engine has at most two steps in flight, the ring holds eight, and a triple
still pending is replaced by a new one rather than re-recorded), and a step's GPU time is read
into a float when its wait ends (StepOutput.wait), before the triple can be recorded again.
"""
from __future__ import annotations

import torch

RING = 8


class StepEvents:
    def __init__(self, device: torch.device):
        self.device_index = device.index if device.index is not None else \
            torch.cuda.current_device()
        self._ring = [self._new() for _ in range(RING)]
        self._next = 0

    @staticmethod
    def _new() -> tuple:
        return (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True),
                torch.cuda.Event())

    def take(self) -> tuple:
        """(start, end, done) for the next step: none of them pending on the device."""
        i = self._next
        self._next = (i + 1) % RING
        trio = self._ring[i]
        if not trio[2].query():          # still in flight (never, at two steps in flight)
            trio = self._ring[i] = self._new()
        return trio

    def stream(self) -> torch.cuda.Stream:
        """The current stream, looked up by index (no availability checks in Python)."""
        return torch.cuda.current_stream(self.device_index)
