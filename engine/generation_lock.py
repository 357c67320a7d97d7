"""GenerationLock: the engine lock, counting the critical sections that may change engine state.

Why: a snapshot of an idle engine is the same snapshot until something changes it. Every
acquisition through `with lock:` (a step's schedule and postprocess, a submit, an abort, a
note) bumps `generation` once it holds the lock; readers enter through `lock.reading()`, which
does not. `LLM.inspect()` keeps its last copy with the generation it was taken at and hands it
out again, holding no lock at all, while the generation has not moved: a page polling an idle
engine never takes the lock the next request needs.

Correctness: the bump happens after the acquisition, so a reader that compares generations
either sees the bump (and copies under the lock, after the writer is done) or runs before the
writer holds the lock (and the kept copy is the state before that writer: consistent). A
thread that saw an event delivered inside a writer's section reads the bump (made before the
event), so it never gets a copy older than what it saw.

A reentrant lock (threading.RLock) inside; `threading.Condition(GenerationLock())` works: the
private hooks Condition looks for are forwarded, and a wait's reacquisition counts as a writer's.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager


class GenerationLock:
    def __init__(self):
        self._inner = threading.RLock()
        self.generation = 0

    # ---- a writer: may change engine state ----------------------------------------------------
    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        ok = self._inner.acquire(blocking, timeout)
        if ok:
            self.generation += 1        # under the lock: no lost increments
        return ok

    def release(self) -> None:
        self._inner.release()

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self._inner.release()

    # ---- a reader: changes nothing, so the generation stays ------------------------------------
    @contextmanager
    def reading(self):
        self._inner.acquire()
        try:
            yield self
        finally:
            self._inner.release()

    # ---- what threading.Condition uses ---------------------------------------------------------
    def _is_owned(self) -> bool:
        return self._inner._is_owned()

    def _release_save(self):
        return self._inner._release_save()

    def _acquire_restore(self, state) -> None:
        self._inner._acquire_restore(state)
        self.generation += 1
