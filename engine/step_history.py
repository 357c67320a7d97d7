"""StepHistory: the engine's recent step traces as a bounded ring that readers copy cheaply.

The engine thread appends one StepTrace per step (records are never changed after that). A
reader gets the window as a tuple that is rebuilt at most once per new step, or only the steps
after a cursor (`since`), so polling the history while the engine runs costs O(new steps).
"""
from __future__ import annotations

import itertools
from collections import deque

from .records import StepTrace


class StepHistory:
    def __init__(self, capacity: int = 256):
        if capacity < 1:
            raise ValueError(f"trace_history must be at least 1, got {capacity}")
        self.capacity = capacity
        self._ring: deque[StepTrace] = deque(maxlen=capacity)
        self._count = 0                     # steps ever appended (the next step's index)
        self._window: tuple[StepTrace, ...] | None = ()

    def append(self, step: StepTrace) -> None:
        self._ring.append(step)
        self._count += 1
        self._window = None                 # rebuilt by the next reader, not by the engine

    def window(self) -> tuple[StepTrace, ...]:
        """The newest `capacity` steps, oldest first (one shared immutable tuple per step)."""
        w = self._window
        if w is None:
            w = self._window = tuple(self._ring)
        return w

    @property
    def count(self) -> int:
        """How many steps were ever appended: a cursor for `since`."""
        return self._count

    def since(self, cursor: int) -> tuple[tuple[StepTrace, ...], int]:
        """(steps appended at or after `cursor` that are still in the ring, the new cursor).
        Steps that fell out of the ring before the reader came back are skipped."""
        new = min(self._count - cursor, len(self._ring))
        if new <= 0:
            return (), self._count
        return tuple(itertools.islice(self._ring, len(self._ring) - new, None)), self._count

    def __len__(self) -> int:
        return len(self._ring)

    def __iter__(self):
        return iter(self.window())

    def __getitem__(self, i):
        return self.window()[i]
