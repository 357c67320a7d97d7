"""EngineHub: the one engine all browser sessions share, and what the views need around it.

It caches `llm.inspect()` briefly (many sessions polling cost one snapshot), keeps the prefix-hit
history that a single snapshot cannot show, maps browser sessions to their requests (so a
closed tab aborts its replies), and swaps the model when the UI asks.
"""
from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Sequence

import gradio as gr

from engine.probes.snapshot import EngineSnapshot

SNAPSHOT_MAX_AGE_S = 0.2


@dataclass
class Session:
    """One browser tab: its in-flight request ids and the reply the Layers tab watches."""
    active: set[str] = field(default_factory=set)
    watched: str | None = None


def format_params(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return str(n)


class EngineHub:
    def __init__(self, llm, llm_kwargs: dict | None = None, choices: dict[str, str] | None = None):
        self.llm = llm
        self.llm_kwargs = dict(llm_kwargs or {})
        self.choices = dict(choices or {})
        self.switching = False      # True while switch() swaps engines: the API answers 503
        self.sessions: dict[str, Session] = {}
        self.hit_history: deque[tuple[float, float]] = deque(maxlen=2000)  # (time, hit rate)
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._snap: EngineSnapshot | None = None
        self._snap_time = 0.0
        self._decode = self._make_decoder()

    # ---- snapshots ------------------------------------------------------------------------
    def snapshot(self, max_age: float = SNAPSHOT_MAX_AGE_S) -> EngineSnapshot:
        """A recent snapshot; at most one `inspect()` per `max_age` however many tabs poll."""
        with self._lock:
            now = time.time()
            if self._snap is None or now - self._snap_time > max_age:
                self._snap = self.llm.inspect()
                self._snap_time = now
                self.hit_history.append((now, self._snap.prefix_hit_rate))
            return self._snap

    # ---- token text -----------------------------------------------------------------------
    def _make_decoder(self):
        tok = self.llm.tokenizer

        @lru_cache(maxsize=65536)
        def decode(ids: tuple[int, ...]) -> str:
            if tok is None:
                return " ".join(map(str, ids))
            return tok.decode(list(ids), skip_special_tokens=False)
        return decode

    def decode(self, ids: Sequence[int]) -> str:
        return self._decode(tuple(int(i) for i in ids))

    # ---- sessions and requests ------------------------------------------------------------
    def session(self, key: str | None) -> Session:
        return self.sessions.setdefault(key or "anonymous", Session())

    def new_request_id(self, kind: str) -> str:
        # trailing counter: sequential replies get distinct colours in every view
        return f"{kind}-{next(self._ids)}"

    def abort_session(self, key: str | None) -> int:
        """Abort every reply the session has in flight; returns how many were aborted."""
        s = self.sessions.get(key or "anonymous")
        if s is None:
            return 0
        return sum(bool(self.llm.abort(rid)) for rid in list(s.active))

    def on_unload(self, request: gr.Request = None) -> None:
        """Tab closed: abort its replies (frees their blocks) and forget the session."""
        key = getattr(request, "session_hash", None)
        self.abort_session(key)
        self.sessions.pop(key or "anonymous", None)

    # ---- model facts and switching --------------------------------------------------------
    def model_line(self) -> str:
        llm = self.llm
        dtype = str(llm.dtype).replace("torch.", "")
        return (f"**{llm.model_name}** · {llm.architecture} · {format_params(llm.num_params)} "
                f"params · {dtype} · {llm.device} · TP {llm.tp_size} · "
                f"{llm.num_kv_blocks} KV blocks × {llm.block_size} tokens · "
                f"max {llm.max_model_len} tokens")

    def current_choice(self) -> str | None:
        path = getattr(self.llm, "model_path", None)
        for name, p in self.choices.items():
            if str(p) == str(path):
                return name
        return None

    def switch(self, choice: str) -> None:
        """Load another bundled model; every in-flight reply is aborted first."""
        self.switching = True
        try:
            self._switch(choice)
        finally:
            self.switching = False

    def _switch(self, choice: str) -> None:
        if choice not in self.choices:
            raise ValueError(f"unknown model {choice!r}; choose one of {list(self.choices)}")
        if choice == self.current_choice():
            return
        from engine import LLM
        for s in self.sessions.values():
            for rid in list(s.active):
                self.llm.abort(rid)
            s.watched = None
        snap = self.llm.inspect()       # API requests too: their streams end with "abort"
        for rid in snap.running + snap.waiting:
            self.llm.abort(rid)
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
            self._decode = self._make_decoder()

    def switch_ui(self, choice: str) -> str:
        try:
            self.switch(choice)
            gr.Info(f"Loaded {choice}")
        except Exception as e:      # a failed load keeps the old model serving
            gr.Warning(f"Could not load {choice}: {e}")
        return self.model_line()
