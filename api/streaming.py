"""EngineStream: one request's TokenEvents handed from the engine thread to the asyncio event
loop without a thread per request and without ever blocking the loop; plus the SSE encoding.

The engine calls `_push` on its own thread for every event (`llm.submit(on_event=...)`): it
appends to the stream's deque and asks the loop's `LoopWaker` to wake the stream. The waker
makes one `call_soon_threadsafe` for a whole burst (a step's events for every stream), so the
cost per token is a deque append, not a thread switch: at 256 concurrent streams a thread per
request (each blocked on its own queue) spent the GIL on hand-offs and starved the engine loop.
Closing a stream that has not finished aborts its request in the engine (from a worker thread:
`abort` takes the engine lock, which a step can hold for a while).

Threads: the server's own pools (api.limits.Pools), never Python's default executor. The
request is checked and tokenized by the engine's processor on the `prepare` pool (api.routes);
queueing it and aborting it run on the `control` pool, so a start or an abort never waits
behind another request's long prompt.
"""
from __future__ import annotations

import asyncio
import json
import threading
import weakref
from collections import deque

DISCONNECT_POLL_S = 0.25


class LoopWaker:
    """Wakes streams on one event loop from other threads: one call_soon_threadsafe (a write to
    the loop's self-pipe) per burst of pushes, however many streams they touch.

    Under load it also paces the wake-ups (the stream interval): each wake-up costs the loop
    ~tens of µs per stream (a task switch, an SSE write), and at 256 streams x one token per
    step that alone held the GIL the engine loop needs. Waking at most every
    `active streams x PACE_S` (capped at MAX_INTERVAL_S) bounds the loop's share whatever the
    load: a few streams get every token at once (8 streams: 3 ms), 256 streams get a burst of a
    few token chunks (one write) 10 times a second. A stream's first token and its end are
    never held back."""
    PACE_S = 0.4e-3
    MAX_INTERVAL_S = 0.1
    _of_loop: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
    _create = threading.Lock()

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._lock = threading.Lock()
        self._pending: list = []
        self._scheduled = False
        self._timer = None
        self._last = 0.0
        self.active = 0             # streams on this loop whose request has not ended (the load)

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> "LoopWaker":
        with cls._create:
            w = cls._of_loop.get(loop)
            if w is None:
                w = cls._of_loop[loop] = cls(loop)
            return w

    def opened(self) -> None:
        with self._lock:
            self.active += 1

    def ended(self) -> None:
        with self._lock:
            self.active -= 1

    def interval(self) -> float:
        return min(self.active * self.PACE_S, self.MAX_INTERVAL_S)

    def wake(self, stream: "EngineStream", urgent: bool = False) -> None:
        with self._lock:
            self._pending.append(stream)
            if self._scheduled and not urgent:
                return
            self._scheduled = True
        try:
            self.loop.call_soon_threadsafe(self._schedule, urgent)
        except RuntimeError:        # the event loop is gone (server shut down): nobody listens
            pass

    def _schedule(self, urgent: bool) -> None:
        """On the loop: wake now, or once the interval since the last wake-up has passed."""
        wait = self._last + self.interval() - self.loop.time()
        if urgent or wait <= 0:
            self._run()
        elif self._timer is None:
            self._timer = self.loop.call_later(wait, self._run)

    def _run(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._last = self.loop.time()
        with self._lock:
            streams, self._pending, self._scheduled = self._pending, [], False
        for s in streams:
            s._ready.set()


class EngineStream:
    def __init__(self, llm, request, pools=None):
        """`request`: an EngineRequest from the engine's processor (checked and tokenized on
        the prepare pool already): queueing it is quick, on the control pool."""
        from .limits import default_pools
        self.llm = llm
        self._pools = pools or default_pools()
        self.request_id = request.request_id
        self._items: deque = deque()
        self._ready = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        self._waker = LoopWaker.of(self._loop)
        self._quiet = False         # the consumer waits for the end only: no wake per token
        self._cancelled = False
        self.ended = False          # the last event or an error is queued
        self.finished = False       # the consumer has seen the final TokenEvent
        self._submitted = threading.Event()
        self._seen_first = False
        self._waker.opened()
        try:
            self._pools.control.submit(self._submit, request)
        except RuntimeError as e:   # the pools are shut down (server stopping)
            self._push(e)
            self._submitted.set()

    # ---- producer side (a worker thread, then the engine thread) ------------------------------
    def _submit(self, request) -> None:
        try:
            self.llm.submit(request, on_event=self._push)
        except BaseException as e:  # engine shut down, id taken: the consumer decides
            self._push(e)
        finally:
            self._submitted.set()

    def _push(self, item) -> None:
        first = not self._seen_first
        self._seen_first = True
        self._items.append(item)
        if isinstance(item, BaseException) or item.finished:
            if not self.ended:
                self._waker.ended()
            self.ended = True
        elif self._quiet:
            return
        self._waker.wake(self, urgent=first or self.ended)

    # ---- consumer side (the event loop) -------------------------------------------------------
    async def _wait_for(self, cond, request=None) -> bool:
        """Wait until cond() holds; False if `request`'s client disconnected meanwhile."""
        next_check = self._loop.time() + DISCONNECT_POLL_S
        while not cond():
            if request is None:
                await self._ready.wait()
            else:
                try:
                    await asyncio.wait_for(self._ready.wait(), DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    pass
                # by the clock, not on timeouts only: tokens wake this loop many times a second
                if self._loop.time() >= next_check:
                    if await request.is_disconnected():
                        return False
                    next_check = self._loop.time() + DISCONNECT_POLL_S
            self._ready.clear()
        return True

    async def wait_first(self, request=None) -> bool:
        """Until the first event (or error) is in: the engine accepted the prompt or refused it."""
        return await self._wait_for(lambda: bool(self._items) or self.ended, request)

    async def wait_end(self, request=None) -> bool:
        """Until the stream is over (the whole reply is queued)."""
        self._quiet = True
        return await self._wait_for(lambda: self.ended, request)

    def first_error(self) -> BaseException | None:
        """The exception if the stream failed before producing any token."""
        if self._items and isinstance(self._items[0], BaseException):
            return self._items[0]
        return None

    def drain(self) -> list:
        """Everything queued now (TokenEvents and at most one exception), without waiting."""
        out = []
        while self._items:
            out.append(self._items.popleft())
        for item in out:
            if not isinstance(item, BaseException) and item.finished:
                self.finished = True
        return out

    async def batches(self):
        """Async iterator of non-empty lists of items, until the stream ends."""
        while True:
            ended = self.ended      # read before draining: nothing can follow the last item
            items = self.drain()
            if items:
                yield items
            if ended and not self._items:
                return
            if not self._items:
                await self._ready.wait()
                self._ready.clear()

    def close(self) -> None:
        """The consumer is gone: abort the request unless it already finished. Non-blocking."""
        if self.finished or self._cancelled:
            return
        self._cancelled = True
        if not self.ended:
            self._pools.control.submit(self._abort)

    def _abort(self) -> None:
        self._submitted.wait()      # a request still being submitted is aborted once it is in
        self.llm.abort(self.request_id)


def sse(payload: dict) -> bytes:
    """One server-sent event."""
    return b"data: " + json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode() \
        + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
