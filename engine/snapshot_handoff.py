"""SnapshotHandoff: while the engine is busy, a reader's snapshot is copied by the engine thread
itself, at its next step boundary, inside the critical section it holds anyway.

Why: a reader copying under the engine lock can lose the GIL mid-copy with the lock held, and
the device runs dry while the engine waits for it (a 1.2–1.5 ms p99 hold on the H200 host for
0.6 ms of copying). Copied by the engine between steps, no reader holds the lock the engine
needs, and the engine pays only the copy's CPU work, once per boundary however many asked.

Consistency: a reader takes a ticket; the engine marks done every ticket taken before its copy
began, so a reader gets a copy newer than anything it saw happen under the lock. When the engine
is idle or a step is long (a CPU prefill), the reader stops waiting after `wait_s` and copies
under the lock itself: uncontended then (the engine is parked or inside a lock-free forward).
"""
from __future__ import annotations

import gc
import threading
import time
from collections import deque

WAIT_S = 0.05           # the longest a reader waits for a boundary before copying itself
POLL_S = 0.005          # how often a waiting reader checks that the engine is still busy


def without_gc(fn, *args):
    """fn(*args) with the cyclic collector held off: a collection that an allocation of the copy
    would trigger runs after it instead, once the lock is released (the copy allocates a few
    hundred tuples, the collector's young-generation threshold is 700: without this, a copy in
    ten held a collection, and a full one walked the whole heap with the engine lock held)."""
    if not gc.isenabled():          # someone else holds it off: leave that to them
        return fn(*args)
    gc.disable()
    try:
        return fn(*args)
    finally:
        gc.enable()


class SnapshotHandoff:
    # no callables kept: the engine hands them in, so this object holds no reference back to
    # it (a cycle would outlive a model switch: the next engine's gc.freeze() keeps it)
    def __init__(self, wait_s: float = WAIT_S):
        self.wait_s = wait_s
        self._cv = threading.Condition(threading.Lock())
        self._asked = 0             # tickets handed out
        self._done = 0              # tickets whose copy is ready
        self._state = None
        # the engine thread's time per copy, newest last: wall and CPU seconds
        self.copy_s: deque = deque(maxlen=4096)
        self.copy_cpu_s: deque = deque(maxlen=4096)
        self.copy_at: deque = deque(maxlen=4096)     # perf_counter() at each copy's start
        self.served = 0             # snapshots handed over by the engine thread
        self.fallbacks = 0          # readers that copied under the lock themselves
        self.reused = 0             # idle-engine readers handed the last copy again, lock-free

    @property
    def wanted(self) -> bool:
        """A reader waits (a plain int compare: the engine checks it every boundary)."""
        return self._asked != self._done

    def take(self, busy):
        """The reader's side: the engine thread's copy, or None (copy under the lock yourself).
        `busy()`: a step boundary is coming."""
        if not busy():
            return None
        deadline = time.perf_counter() + self.wait_s
        with self._cv:
            self._asked += 1
            ticket = self._asked
            while self._done < ticket:
                left = deadline - time.perf_counter()
                if left <= 0 or not busy():
                    self.fallbacks += 1
                    return None
                self._cv.wait(min(left, POLL_S))
            self.served += 1
            return self._state

    def serve(self, copy) -> None:
        """The engine thread's side, with the engine lock held: at a step boundary, or while
        it waits for the device inside a step. `copy()` takes the state."""
        ticket = self._asked                    # every reader that asked before the copy
        t0, c0 = time.perf_counter(), time.thread_time()
        state = without_gc(copy)
        self.copy_at.append(t0)
        self.copy_s.append(time.perf_counter() - t0)
        self.copy_cpu_s.append(time.thread_time() - c0)
        with self._cv:
            self._state = state
            self._done = max(self._done, ticket)
            self._cv.notify_all()

    def serve_if_wanted(self, copy) -> None:
        """At a step boundary, the engine lock held: serve the readers waiting, if any."""
        if self.wanted:
            self.serve(copy)

    def serve_while_waiting(self, lock, copy) -> None:
        """While the engine thread waits for the device (the lock is free: a step's changes are
        made before its launch and after the wait): a reader gets its copy now, not a whole
        (long: a big prefill) step later."""
        if self.wanted:
            with lock.reading():
                if self.wanted:
                    self.serve(copy)

    def clear(self) -> None:
        """Drop the last copy (it references the engine): at shutdown."""
        with self._cv:
            self._state = None
