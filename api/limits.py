"""Bounds a request meets before it costs the server anything, and the worker pools that do a
request's preparation off the event loop.

- `Limits`: the request body size (checked by api.guard before the body is read), the number
  and length of stop strings and stop token ids (vLLM-like caps, all configurable).
- `parse_body`: JSON -> the pydantic request in strict mode (`"temperature": true` is refused,
  not read as 1.0), with every malformed body a 400 (invalid UTF-8 or JSON, 5,000-digit numbers,
  deep nesting, lone surrogates: pydantic's own JSON parser refuses them all).
- `Pools`: the server's own bounded thread pools, never Python's default executor: `prepare`
  (parse, validate, tokenize: can take a while for a long prompt) and `control` (queue a
  prepared request, abort one: always quick), so a start or an abort never waits behind a long
  preparation; a full prepare queue answers 503 instead of growing.
- `trim_heap`: glibc keeps freed memory in its arenas; after a large request the server gives
  it back (`malloc_trim`), so RSS returns near its baseline.
"""
from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, TypeVar

from pydantic import BaseModel, ValidationError

from .errors import APIError, bad_request, from_validation

log = logging.getLogger("glassbox.api")
T = TypeVar("T")


@dataclass(frozen=True)
class Limits:
    max_request_bytes: int = 4 << 20        # a request body (JSON or form); 413 above
    max_stop_strings: int = 64              # OpenAI allows 4; vLLM does not cap
    # characters of one stop string: the request's stop-string automaton has one node per
    # character (engine/stop_strings.py), built in Python when the request is prepared
    max_stop_chars: int = 256
    max_stop_token_ids: int = 1024
    prepare_workers: int = 2                # threads parsing and tokenizing requests
    max_pending: int = 256                  # preparations queued or running; 503 above
    heavy_request_bytes: int = 256 << 10    # a body this large is followed by a heap trim
    # admission by cost, checked before any work (vLLM has no such caps; each is a flag)
    max_choices: int = 64                   # prompts x n: each choice is a request in the engine
    # logprob entries a reply may carry (tokens x (1 + top alternatives), choices summed, prompt
    # logprobs included): ~60 bytes of JSON each, so the default bounds a reply near 16 MB
    max_logprob_entries: int = 1 << 18


def check_stop_limits(stop, stop_token_ids, limits: Limits) -> None:
    """400 naming `stop` or `stop_token_ids` when a request exceeds the caps."""
    stops = [stop] if isinstance(stop, str) else list(stop or ())
    if len(stops) > limits.max_stop_strings:
        raise bad_request(f"stop holds {len(stops)} strings; at most {limits.max_stop_strings} "
                          "are allowed (--max-stop-strings)", "stop")
    for i, s in enumerate(stops):
        if len(s) > limits.max_stop_chars:
            raise bad_request(f"stop[{i}] is {len(s)} characters long; at most "
                              f"{limits.max_stop_chars} are allowed (--max-stop-chars)", "stop")
    n = len(stop_token_ids or ())
    if n > limits.max_stop_token_ids:
        raise bad_request(f"stop_token_ids holds {n} ids; at most {limits.max_stop_token_ids} "
                          "are allowed (--max-stop-token-ids)", "stop_token_ids")


def check_cost(body, chat: bool, limits: Limits) -> None:
    """400 naming the field when a request asks for more than the server's caps, from what the
    body says alone (before tokenizing): its number of choices."""
    n_prompts = 1
    if not chat:
        p = body.prompt
        n_prompts = len(p) if isinstance(p, list) and p and isinstance(p[0], (str, list)) else 1
    choices = n_prompts * body.n
    if choices > limits.max_choices:
        raise bad_request(f"{n_prompts} prompt(s) x n={body.n} make {choices} choices; at most "
                          f"{limits.max_choices} per request are allowed (--max-choices): send "
                          "several requests instead (they batch together)",
                          "n" if n_prompts == 1 else "prompt")


def check_logprob_cost(specs, top_n: int, want_logprobs: bool, limits: Limits) -> None:
    """400 when the reply's logprobs would pass the cap (the choices' token budgets known)."""
    total = 0
    for s in specs:
        p = s.request.params
        if want_logprobs:
            total += p.max_tokens * (1 + top_n)
        if p.prompt_logprobs is not None:
            total += len(s.request.prompt) * (1 + p.prompt_logprobs)
    if total > limits.max_logprob_entries:
        raise bad_request(f"this request's logprobs could reach {total:,} entries (tokens x "
                          f"(1 + alternatives), every choice); at most "
                          f"{limits.max_logprob_entries:,} are allowed (--max-logprob-entries): "
                          "lower max_tokens, n or top_logprobs", "top_logprobs" if want_logprobs
                          else "prompt_logprobs")


def parse_body(raw: bytes, model: type[BaseModel]) -> BaseModel:
    """The request body as `model`, or a 400 that says what is wrong. Blocking: call it on the
    prepare pool (a 4 MB body takes tens of milliseconds)."""
    if not raw.strip():
        raise bad_request("the request needs a JSON body")
    try:
        return model.model_validate_json(raw, strict=True)
    except ValidationError as e:
        raise from_validation(e) from None
    except RecursionError:      # belt and braces: pydantic's parser caps nesting itself
        raise bad_request("the request body is nested too deeply") from None


class Pools:
    """The server's worker pools (see the module docstring)."""

    def __init__(self, limits: Limits | None = None):
        self.limits = limits or Limits()
        self.prepare = ThreadPoolExecutor(self.limits.prepare_workers,
                                          thread_name_prefix="glassbox-prepare")
        self.control = ThreadPoolExecutor(2, thread_name_prefix="glassbox-control")
        self._pending = 0
        self._lock = threading.Lock()

    async def run_prepare(self, fn: Callable[[], T]) -> T:
        """fn() on the prepare pool; 503 when too many preparations are queued already."""
        with self._lock:
            if self._pending >= self.limits.max_pending:
                raise APIError(503, f"the server is busy preparing {self._pending} requests; "
                                    "retry in a moment", code="server_busy",
                               headers={"Retry-After": "1"})
            self._pending += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self.prepare, fn)
        finally:
            with self._lock:
                self._pending -= 1

    def shutdown(self) -> None:
        self.prepare.shutdown(wait=False, cancel_futures=True)
        self.control.shutdown(wait=False, cancel_futures=True)


_DEFAULT: Pools | None = None
_DEFAULT_LOCK = threading.Lock()


def default_pools() -> Pools:
    """Pools for EngineStreams made without a server's own (tests, scripts)."""
    global _DEFAULT
    with _DEFAULT_LOCK:
        if _DEFAULT is None:
            _DEFAULT = Pools()
        return _DEFAULT


# ---- giving freed memory back ------------------------------------------------------------------
def _libc_trim():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        fn = libc.malloc_trim
    except (OSError, AttributeError):       # not glibc (musl, macOS): nothing to trim
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


_TRIM = _libc_trim()
_trim_lock = threading.Lock()
_last_trim = 0.0
TRIM_MIN_INTERVAL_S = 1.0


def trim_heap(force: bool = False) -> bool:
    """malloc_trim(0): return the free pages of every glibc arena to the OS (ctypes releases
    the GIL during the call). At most once a second unless forced. True if it ran."""
    global _last_trim
    if _TRIM is None:
        return False
    with _trim_lock:
        now = time.monotonic()
        if not force and now - _last_trim < TRIM_MIN_INTERVAL_S:
            return False
        _last_trim = now
    _TRIM(0)
    return True
