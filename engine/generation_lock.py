"""GenerationLock: the engine lock (an RLock), counting the sections that may change state.

Why: an idle engine's snapshot stays valid until something changes it. Every `with lock:` (a
step's schedule and postprocess, a submit, an abort, a note) bumps `generation` once it holds
the lock; readers enter through `lock.reading()`, which does not. `LLM.inspect()` hands its last
copy out again, lock-free, while the generation has not moved: a page polling an idle engine
never takes the lock the next request needs.

Correctness: the bump follows the acquisition, so a reader comparing generations either sees it
(and copies under the lock, after the writer) or ran before the writer held the lock (its copy
is the state before that writer). A thread that saw an event delivered inside a writer's
section reads the bump made before it, so never gets an older copy. `threading.Condition`
works on it: its private hooks are forwarded, and a wait's reacquisition counts as a writer's.
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
