"""EngineHub: the one engine all browser sessions share, and what the views need around it.

It caches `llm.inspect()` briefly (many sessions polling cost one snapshot), keeps the prefix-hit
history that a single snapshot cannot show, maps browser sessions to their requests (so a
closed tab aborts its replies), remembers why a request was aborted (so a cut reply can say
why), and swaps the model when the UI asks; `generation` counts swaps so every open tab can
notice that the model changed under it.
"""
from __future__ import annotations

import itertools
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Callable, NamedTuple, Sequence

import gradio as gr

from engine.probes.snapshot import EngineSnapshot

SNAPSHOT_MAX_AGE_S = 0.2
# live tabs poll fast while the engine works and slowly when it idles. Gradio's timer fires on
# a setInterval and drops a tick while the previous one is in flight, so an update every
# `interval * ceil(update time / interval)`: a short interval keeps that close to the update time
TICK_BUSY_S = 0.2
TICK_IDLE_S = 1.0
IDLE_AFTER_S = 1.5
MAX_ABORT_REASONS = 1024
DEMO_DIR = Path(__file__).resolve().parents[1] / "assets"


def tick_interval(snap: EngineSnapshot, now: float | None = None) -> float:
    """TICK_BUSY_S while requests run or a step ran recently, else TICK_IDLE_S."""
    now = time.time() if now is None else now
    recent = bool(snap.steps) and now - snap.steps[-1].wall_time < IDLE_AFTER_S
    return TICK_BUSY_S if snap.running or snap.waiting or recent else TICK_IDLE_S


def pace(timer: gr.Timer, keys: dict, snap: EngineSnapshot, out: dict) -> None:
    """Put a new interval for `timer` into `out` when the engine went busy or idle."""
    interval = tick_interval(snap)
    if keys.get("interval") != interval:
        out[timer] = gr.Timer(value=interval)
        keys["interval"] = interval


class LiveTab(NamedTuple):
    """What a live tab hands to app.py: its timer (on only while the tab shows) and its
    refresh (run once at once when the tab is opened, so it never opens blank)."""
    timer: gr.Timer
    refresh: Callable
    inputs: list
    outputs: list


@dataclass
class Session:
    """One browser tab: its in-flight request ids, its chat replies, and the latest of them
    (what the Layers tab shows by default)."""
    active: set[str] = field(default_factory=set)
    watched: str | None = None
    replies: deque = field(default_factory=lambda: deque(maxlen=64))


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
        self.sessions: dict[str, Session] = {}
        self.hit_history: deque[tuple[float, float]] = deque(maxlen=2000)  # (time, hit rate)
        self.generation = 0            # +1 per model swap: tabs compare it to notice a swap
        # the choice being loaded while a swap runs (truthy: the API answers 503, tabs wait)
        self.switching: str | None = None
        self.closing = False
        self._abort_reasons: OrderedDict[str, str] = OrderedDict()
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._switch_lock = threading.Lock()
        self._snap: EngineSnapshot | None = None
        self._snap_time = 0.0
        self._decode = self._make_decoder()

    # ---- snapshots ------------------------------------------------------------------------
    def snapshot(self, max_age: float = SNAPSHOT_MAX_AGE_S) -> EngineSnapshot:
        """A recent snapshot; at most one `inspect()` per `max_age` however many tabs poll.
        While a model swap runs, the last snapshot of the old engine."""
        with self._lock:
            now = time.time()
            stale = self._snap is None or now - self._snap_time > max_age
            if stale and (self.switching is None or self._snap is None):
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

    def abort_session(self, key: str | None, reason: str = "stopped by user") -> int:
        """Abort every reply the session has in flight; returns how many were aborted."""
        s = self.sessions.get(key or "anonymous")
        if s is None:
            return 0
        return sum(self.abort(rid, reason) for rid in list(s.active))

    def on_unload(self, request: gr.Request = None) -> None:
        """Tab closed: abort its replies (frees their blocks) and forget the session."""
        key = getattr(request, "session_hash", None)
        self.abort_session(key, "the browser tab was closed")
        self.sessions.pop(key or "anonymous", None)

    def shutdown(self) -> None:
        """The server is stopping: cut every reply with that reason, then stop the engine."""
        self.closing = True
        for s in list(self.sessions.values()):
            for rid in list(s.active):
                self.abort(rid, "the server is shutting down")
        self.llm.shutdown()

    # ---- model facts and switching --------------------------------------------------------
    def model_line(self) -> str:
        llm = self.llm
        dtype = str(llm.dtype).replace("torch.", "")
        line = (f"**{llm.model_name}** · {llm.architecture} · {format_params(llm.num_params)} "
                f"params · {dtype} · {llm.device} · TP {llm.tp_size} · "
                f"{llm.num_kv_blocks} KV blocks × {llm.block_size} tokens · "
                f"max {llm.max_model_len} tokens")
        if self.switching:
            line = f"⏳ loading **{self.switching}** (replies wait) · was: " + line
        return line

    def is_demo(self) -> bool:
        """True for the bundled demo checkpoints (greedy defaults, task examples)."""
        path = Path(getattr(self.llm, "model_path", "") or "")
        return path.name.startswith("demo-qwen3") and path.resolve().parent == DEMO_DIR

    def current_choice(self) -> str | None:
        path = getattr(self.llm, "model_path", None)
        for name, p in self.choices.items():
            if str(p) == str(path):
                return name
        return None

    def switch(self, choice: str) -> None:
        """Load another bundled model; every in-flight reply is aborted first (with that
        reason). One swap at a time; a failed load brings the old model back and raises."""
        if choice not in self.choices:
            raise ValueError(f"unknown model {choice!r}; choose one of {list(self.choices)}")
        from engine import LLM
        with self._switch_lock:
            if choice == self.current_choice():
                return
            self.switching = choice
            try:
                why = f"the model was switched to {choice}"
                for s in list(self.sessions.values()):
                    for rid in list(s.active):
                        self.abort(rid, why)
                    s.watched = None
                snap = self.llm.inspect()   # API requests too: their streams end with "abort"
                for rid in snap.running + snap.waiting:
                    self.abort(rid, why)
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
                self.generation += 1
                self.switching = None
