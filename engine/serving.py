"""ServingHub: the one owner of the engine's life cycle for every front end (views/, api/).

Front ends read `hub.llm` once per request and keep that engine to the request's end. The hub
loads, switches and shuts the engine down, says when it is `switching` (the API answers 503),
shares one recent snapshot between every reader, and remembers why a request was aborted so a
cut reply can say why. It knows nothing of Gradio: views/live.py adds browser sessions on top.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from functools import lru_cache
from typing import Callable, Sequence

from .client import EngineClient
from .errors import EngineShutdownError, ModelSwitchingError
from .processor import new_request_id
from .records import EngineSnapshot

SNAPSHOT_MAX_AGE_S = 0.2
MAX_ABORT_REASONS = 1024


class ServingHub:
    def __init__(self, llm, llm_kwargs: dict | None = None, choices: dict[str, str] | None = None):
        self.llm = llm
        self.llm_kwargs = dict(llm_kwargs or {})
        self.choices = dict(choices or {})     # name -> checkpoint path a switch may load
        self.hit_history: deque[tuple[float, float]] = deque(maxlen=2000)  # (time, hit rate)
        self.generation = 0            # +1 per model swap: readers compare it to notice a swap
        # the choice being loaded while a swap runs (truthy: the API answers 503, tabs wait)
        self.switching: str | None = None
        self.closing = False
        # a shared server salts each user's prefix-cache chain (engine/cache_salt.py): a page's
        # by its browser session, an API client's by who it is (api/routes.prefix_cache_salt)
        self.isolate_prefix_cache = False
        self.served_model_names: tuple[str, ...] = ()     # vLLM's --served-model-name
        self._abort_reasons: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()
        self._switch_lock = threading.Lock()
        self._snap: EngineSnapshot | None = None
        self._snap_time = 0.0
        self._decode = None            # made on first use (a hub may start without an engine)
        self._on_switch: list[Callable[[], None]] = []

    def current(self) -> EngineClient:
        """The engine serving now; ModelSwitchingError while a switch loads the next one (the
        API answers it with 503 and Retry-After)."""
        if self.switching:
            raise ModelSwitchingError(f"the model is being switched to {self.switching}; "
                                      "retry in a few seconds")
        return self.llm

    # ---- snapshots ------------------------------------------------------------------------
    def snapshot(self, max_age: float = SNAPSHOT_MAX_AGE_S) -> EngineSnapshot:
        """A recent snapshot; at most one `inspect()` per `max_age` however many readers poll.
        While a model swap runs, the last snapshot of the old engine."""
        with self._lock:
            now = time.time()
            stale = self._snap is None or now - self._snap_time > max_age
            if stale and (self.switching is None or self._snap is None):
                try:
                    self._snap = self.llm.inspect()
                except EngineShutdownError:
                    if self._snap is None:     # nothing to show yet: the caller says so
                        raise
                    return self._snap          # a swap began between the check and the read
                self._snap_time = now
                self.hit_history.append((now, self._snap.prefix_hit_rate))
            return self._snap

    # ---- token text -----------------------------------------------------------------------
    def decode(self, ids: Sequence[int]) -> str:
        if self._decode is None:
            tok = getattr(self.llm, "tokenizer", None)

            @lru_cache(maxsize=65536)
            def decode(ids: tuple[int, ...]) -> str:
                if tok is None:
                    return " ".join(map(str, ids))
                return tok.decode(list(ids), skip_special_tokens=False)
            self._decode = decode
        return self._decode(tuple(int(i) for i in ids))

    # ---- requests -------------------------------------------------------------------------
    def new_request_id(self, kind: str) -> str:
        return new_request_id(kind)

    def session_salt(self, session_key: str | None) -> str | None:
        """The cache salt of a browser session's requests (None: a single-user server)."""
        if not self.isolate_prefix_cache:
            return None
        import hashlib
        return hashlib.sha256(f"session\x1f{session_key}".encode()).hexdigest()

    def abort(self, request_id: str, reason: str) -> bool:
        """Abort one request in the engine, remembering why (the reply shows it)."""
        self._abort_reasons[request_id] = reason
        while len(self._abort_reasons) > MAX_ABORT_REASONS:
            self._abort_reasons.popitem(last=False)
        return bool(self.llm.abort(request_id))

    def abort_reason(self, request_id: str) -> str:
        """Why a request ended with finish_reason "abort" (and forget it)."""
        if request_id in self._abort_reasons:
            return self._abort_reasons.pop(request_id)
        return "shutting down" if self.closing else "aborted in the engine"

    def abort_all(self, reason: str) -> None:
        """Abort every request the engine holds (the playground's and the API's)."""
        snap = self.llm.inspect()
        for rid in snap.running + snap.waiting:
            self.abort(rid, reason)

    # ---- life cycle -----------------------------------------------------------------------
    def on_switch(self, hook: Callable[[], None]) -> None:
        """Call `hook` at the start of every switch, before the old engine is shut down (a
        front end forgets what it kept about the old engine's requests)."""
        self._on_switch.append(hook)

    def current_choice(self) -> str | None:
        path = str(getattr(self.llm, "model_path", None))
        return next((name for name, p in self.choices.items() if str(p) == path), None)

    def switch(self, choice: str) -> None:
        """Load another model from `choices`; every in-flight request is aborted first (with
        that reason). One swap at a time; a failed load brings the old model back and raises."""
        if choice not in self.choices:
            raise ValueError(f"unknown model {choice!r}; choose one of {list(self.choices)}")
        from .llm import LLM
        with self._switch_lock:
            if choice == self.current_choice():
                return
            self.switching = choice
            try:
                for hook in self._on_switch:
                    hook()
                self.abort_all(f"the model was switched to {choice}")
                # free the old engine first: two models need not fit in memory at once
                old_path = self.llm.model_path
                self.llm.shutdown()
                try:
                    self.llm = LLM(self.choices[choice], **self.llm_kwargs)
                except Exception:
                    self.llm = LLM(old_path, **self.llm_kwargs)
                    raise
            finally:
                with self._lock:
                    self._snap = None
                    self.hit_history.clear()
                self._decode = None         # the next model's tokenizer, on first use
                self.generation += 1
                self.switching = None

    def shutdown(self, reason: str = "the server is shutting down") -> None:
        """The server is stopping: cut every request with that reason, then stop the engine."""
        self.closing = True
        try:
            self.abort_all(reason)
        except EngineShutdownError:
            pass
        self.llm.shutdown()
