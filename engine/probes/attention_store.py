"""AttentionStore: where a watched request's attention rows wait on the GPU, and how they leave.

A watched token's rows (layers x heads x context, fp32) are ~0.7 MB at Qwen3-0.6B shapes:
copying them to the host in the step costs the engine thread milliseconds, and copying them
when a reader asks made every Layers tick move ~64 MB. So they stay on the device where the
step left them (a reader moves the one row it shows), and this store keeps the device bytes
under a budget by moving the oldest rows to host memory from a thread and a CUDA stream of its
own: the engine thread only appends to a deque.
"""
from __future__ import annotations

import threading
from collections import deque

from .trace import AttentionStep, move_to_host, side_stream

CHUNK_BYTES = 32 << 20      # one spill: a joined copy of about this many bytes


class AttentionStore:
    """Device-held attention rows, oldest first, and the thread that moves them past a budget."""

    def __init__(self, budget_bytes: int = 512 << 20, chunk_bytes: int = CHUNK_BYTES):
        self.budget_bytes = budget_bytes
        self.chunk_bytes = chunk_bytes
        self._held: deque[tuple[str, AttentionStep]] = deque()
        self._bytes = 0
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stop = False
        self.spills = 0             # joined copies made (tests, bench)

    @property
    def device_bytes(self) -> int:
        return self._bytes

    def add(self, request_id: str, step: AttentionStep) -> None:
        """A step's rows, still on the device (engine thread: a deque append)."""
        if step.device_rows is None:
            return
        with self._cv:
            self._held.append((request_id, step))
            self._bytes += _nbytes(step)
            if self._bytes > self.budget_bytes:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="attention-spill",
                                                    daemon=True)
                    self._thread.start()
                self._cv.notify()

    def forget(self, request_id: str) -> None:
        """A trace was evicted: its rows are no longer worth a copy (readers holding a frozen
        copy still move a row themselves when they show it)."""
        with self._cv:
            self._held = deque((r, s) for r, s in self._held if r != request_id)
            self._bytes = sum(_nbytes(s) for _, s in self._held)

    def flush(self) -> None:
        """Move every held row to the host now (engine shutdown: traces stay readable)."""
        with self._cv:
            steps = [s for _, s in self._held]
            self._held.clear()
            self._bytes = 0
            self._stop = True
            self._cv.notify()
        if self._thread is not None:
            # a daemon thread still inside a torch call when the interpreter exits aborts it
            # (see tests/test_exit.py): wait for the spill in progress before returning
            self._thread.join(timeout=30)
        move_to_host(steps, None)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._stop and self._bytes <= self.budget_bytes:
                    self._cv.wait()
                if self._stop:
                    return
                batch, size = [], 0
                while self._held and size < self.chunk_bytes:
                    _, st = self._held.popleft()
                    n = _nbytes(st)
                    self._bytes -= n
                    if n:
                        batch.append(st)
                        size += n
            try:
                move_to_host(batch, side_stream())
                self.spills += 1
            except Exception:       # noqa: BLE001 — a failed spill leaves rows on the device,
                pass                # where readers still find them; the engine goes on


def _nbytes(step: AttentionStep) -> int:
    rows = step.device_rows
    return 0 if rows is None else rows.numel() * rows.element_size()
