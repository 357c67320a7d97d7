"""EngineLoop: the engine thread. It owns the EngineCore, takes processed requests in, runs
steps while there is work, and delivers each StepResult's events and failures to the requests'
sinks (a queue's put for generate/stream, a caller's on_event for submit).

A step that fails outside what one request's data explains fails the requests in flight and
the loop serves on; a dead worker, or MAX_STEP_FAILURES such steps in a row (a broken device),
ends the engine, and every later request is refused with the reason. `lock` (a GenerationLock
shared with the core and the inspector) is held only while engine state changes.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from .errors import (EngineFailedError, EngineShutdownError, InvalidArgumentError,
                     RequestFailedError)
from .processor import EngineRequest
from .sequence import Sequence, TokenEvent

MAX_NOTE = 200          # characters of a request's note kept (a row, not a log)
MAX_STEP_FAILURES = 3   # steps failing in a row, each failing what was in flight, end the engine

log = logging.getLogger("glassbox")


class EngineLoop:
    def __init__(self, core, probes, lock, name: str,
                 between_steps: Callable[[], None] | None = None):
        self.core = core
        self.probes = probes
        self.lock = lock
        self._wake = threading.Condition(lock)
        self._between_steps = between_steps     # under the lock after each step's delivery
        self._seqs: dict[str, Sequence] = {}
        self._sinks: dict[str, Callable[[object], None]] = {}
        # called with every request's final TokenEvent (engine thread, lock held: be quick)
        self.finish_listeners: list[Callable[[TokenEvent], None]] = []
        # called with the token count of every engine step (engine thread, lock held)
        self.step_listeners: list[Callable[[int], None]] = []
        self._stop = False
        self.closed = False
        self.error: BaseException | None = None     # why the engine ended, if it failed
        self._step_failures = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # ---- state, read without the lock --------------------------------------------------------
    @property
    def alive(self) -> bool:
        return not self._stop and self.error is None and self._thread.is_alive()

    def busy(self) -> bool:
        """A step boundary is coming (a hint, read without the lock)."""
        return not self._stop and self.error is None and self.core.has_work()

    def on_engine_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def check_open(self) -> None:
        if self.closed:
            raise EngineShutdownError("the engine has been shut down; create a new LLM")

    # ---- requests -----------------------------------------------------------------------------
    def add(self, requests: list[EngineRequest], sinks: list[Callable[[object], None]]) -> None:
        """Queue processed requests together (one batch's prompts are scheduled together)."""
        with self._wake:
            if self._stop or not self._thread.is_alive():
                raise EngineShutdownError("the engine has been shut down; create a new LLM")
            if self.error is not None:
                raise EngineFailedError(f"the engine failed ({self.error!r}) and cannot serve "
                                        "requests; create a new LLM") from self.error
            ids = [r.request_id for r in requests]
            taken = next((i for i in ids if i in self._seqs), None)
            if taken is not None or len(set(ids)) != len(ids):
                raise InvalidArgumentError(f"request id {taken or ids[0]!r} is already in use; "
                                           "give a new one (or None for a generated id)",
                                           "request_id")
            for req, sink in zip(requests, sinks):
                seq = Sequence.from_request(req)
                self._seqs[seq.request_id] = seq
                self._sinks[seq.request_id] = sink
                if self.probes is not None:
                    self.probes.register(seq)
                self.core.add(seq)
            self._wake.notify()

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its KV blocks. False if it is unknown or done."""
        with self._wake:
            seq = self._seqs.get(request_id)
            if seq is None or seq.is_finished:
                return False
            self._deliver(self.core.abort(seq))
            return True

    def annotate(self, request_id: str, note: str) -> bool:
        if not isinstance(note, str):
            raise TypeError(f"a request's note must be a string, got {type(note).__name__}")
        with self.lock:
            seq = self._seqs.get(request_id)
            if seq is None or seq.is_finished:
                return False
            seq.annotation = note[:MAX_NOTE]
            return True

    # ---- the thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._stop and not self.core.has_work():
                    self._wake.wait()
                if self._stop:
                    return
            try:
                result = self.core.step()
                self._step_failures = 0
            except BaseException as e:      # noqa: BLE001 — see the module docstring
                self._step_failures += 1
                fatal = (isinstance(e, EngineFailedError) or not isinstance(e, Exception)
                         or self._step_failures >= MAX_STEP_FAILURES)
                with self.lock:
                    if fatal:
                        self.error = e
                        self._fail_all(e)
                    else:
                        self._fail_all(RequestFailedError(
                            f"an engine step failed while this request was in it: {e!r}"))
                continue
            with self.lock:
                for rid, err in result.failures:        # one request's own failure
                    self._fail_one(rid, err)
                for ev in result.events:
                    self._deliver(ev)
                for n in result.step_tokens:
                    for listener in self.step_listeners:    # e.g. /metrics' iteration tokens
                        _call(listener, n)
                if self._between_steps is not None:     # e.g. a reader waits for a snapshot
                    self._between_steps()
            # between steps: give waiting threads the lock; CPython locks are not fair
            time.sleep(0)

    def _deliver(self, ev: TokenEvent) -> None:
        sink = self._sinks.get(ev.request_id)
        if ev.finished:
            self._sinks.pop(ev.request_id, None)
            self._seqs.pop(ev.request_id, None)
            for listener in self.finish_listeners:     # e.g. the API's /metrics histograms
                _call(listener, ev)
        if sink is not None:
            _call(sink, ev)

    def _fail_one(self, rid: str, err: BaseException) -> None:
        seq = self._seqs.pop(rid, None)
        if seq is not None and not seq.is_finished:
            self.core.scheduler.finish(seq, "abort")
            if self.probes is not None:
                self.probes.finish_request(seq)
        sink = self._sinks.pop(rid, None)
        if sink is not None:
            _call(sink, err)

    def _fail_all(self, err: BaseException) -> None:
        self.core.inflight = None
        for rid in list(self._seqs):
            self._fail_one(rid, err)
        self.core.detok.clear()

    def shutdown(self) -> None:
        """Stop the thread and fail every request still in flight (EngineShutdownError)."""
        with self._wake:
            if self._stop and self.closed:
                return
            self._stop = True
            self._wake.notify_all()
        if not self.on_engine_thread():
            self._thread.join(timeout=30)
        with self.lock:
            self._fail_all(EngineShutdownError(
                "the engine was shut down while this request was in flight"))
            self.closed = True


def _call(sink, item) -> None:
    try:
        sink(item)
    except Exception:   # noqa: BLE001 — a consumer's bug must not stop the engine loop
        log.exception("a request's on_event callback raised")
