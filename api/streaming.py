"""EngineStream: one `llm.stream` (a blocking generator) run in its own thread, its TokenEvents
handed to the asyncio event loop without ever blocking it; plus the SSE encoding.

Why a thread per request: `llm.stream` blocks on its request's queue between tokens, and
starlette's shared thread pool (40 threads) would serialise hundreds of concurrent streams.
The thread appends to a deque and wakes the loop at most once per batch of events
(`call_soon_threadsafe` only when no wake-up is pending), so a slow consumer drains several
tokens per wake-up. Closing a stream that has not finished aborts its request in the engine
(from a worker thread: `abort` takes the engine lock, which a step can hold for a while).
"""
from __future__ import annotations

import asyncio
import json
import threading
from collections import deque

DISCONNECT_POLL_S = 0.25
_END = object()


class EngineStream:
    def __init__(self, llm, prompt, sampling, watch, request_id: str):
        self.llm = llm
        self.request_id = request_id
        self._args = (prompt, sampling, watch)
        self._items: deque = deque()
        self._ready = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        self._wake_pending = False
        self._quiet = False         # the consumer waits for the end only: no wake per token
        self._cancelled = False
        self.ended = False          # the producer thread is done (set before _END is queued)
        self.finished = False       # the consumer has seen the final TokenEvent
        self._thread = threading.Thread(target=self._produce, daemon=True,
                                        name=f"api-stream-{request_id}")
        self._thread.start()

    # ---- producer side (its own thread) -------------------------------------------------------
    def _produce(self) -> None:
        try:
            if self._cancelled:
                return
            gen = self.llm.stream(*self._args, request_id=self.request_id)
            for ev in gen:
                self._push(ev)
                if self._cancelled and not ev.finished:
                    gen.close()     # llm.stream aborts the request when closed early
                    break
        except BaseException as e:  # bad prompt, engine failure, shutdown: the consumer decides
            self._push(e)
        finally:
            self.ended = True
            self._push(_END)

    def _push(self, item) -> None:
        self._items.append(item)
        if self._quiet and item is not _END:
            return
        if not self._wake_pending:
            self._wake_pending = True
            try:
                self._loop.call_soon_threadsafe(self._wake)
            except RuntimeError:    # the event loop is gone (server shut down): nobody listens
                pass

    def _wake(self) -> None:
        self._wake_pending = False
        self._ready.set()

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
            item = self._items.popleft()
            if item is not _END:
                out.append(item)
        for item in out:
            if not isinstance(item, BaseException) and item.finished:
                self.finished = True
        return out

    async def batches(self):
        """Async iterator of non-empty lists of items, until the stream ends."""
        while True:
            items = self.drain()
            if items:
                yield items
            if self.ended and not self._items:
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
            self._loop.run_in_executor(None, self.llm.abort, self.request_id)


def sse(payload: dict) -> bytes:
    """One server-sent event."""
    return b"data: " + json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode() \
        + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
