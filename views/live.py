"""EngineHub: the serving hub (engine/serving.py) with what the browser pages need around it.

The hub owns the engine's life cycle (load, switch, shutdown), shares one recent snapshot
between every page, keeps the prefix-hit history, and remembers why a request was aborted.
This file adds browser sessions (so a closed tab aborts its replies, and each page has its
own watched reply), the model line, and the live tabs' pacing.
"""
from __future__ import annotations

import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, NamedTuple

import gradio as gr

from engine.records import EngineSnapshot
from engine.serving import SNAPSHOT_MAX_AGE_S, ServingHub  # noqa: F401  (re-exported)
from views.engine_timeline import history_for
# live tabs poll fast while the engine works and slowly when it idles. Gradio's timer fires on
# a setInterval and drops a tick while the previous one is in flight, so an update every
# `interval * ceil(update time / interval)`: a short interval keeps that close to the update time
TICK_BUSY_S = 0.2
TICK_IDLE_S = 1.0
IDLE_AFTER_S = 1.5
# a live tab's snapshot may be at most this old: half a busy tick, so consecutive ticks never
# read the same shared snapshot (with the hub's default 0.2 s, a 0.2 s tick saw the snapshot of
# the tick before about every other time and drew nothing new: ~3 updates/s at best)
LIVE_SNAPSHOT_AGE_S = TICK_BUSY_S / 2
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


# Progress targets: the page's events name a gr.State in show_progress_on (their loading
# status is hidden anyway), because Gradio 6's page re-sends a loading status to every
# component any event ever reported one for, on every later event (each streamed token and
# each live tick included), and copies each such component's props ($state.snapshot) as it
# does, its children's too for a row: ~3 ms a component on two cores, the whole conversation
# for the chatbot. A State is not drawn, so the copy is skipped.


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


class EngineHub(ServingHub):
    """The serving hub (engine/serving.py: the engine's life cycle, shared snapshots, abort
    reasons) plus what the browser needs: sessions, the model line, the demo flag."""

    def __init__(self, llm, llm_kwargs: dict | None = None, choices: dict[str, str] | None = None):
        super().__init__(llm, llm_kwargs, choices)
        self.sessions: dict[str, Session] = {}
        self.on_switch(self._forget_watched)
        self._counted: weakref.WeakSet = weakref.WeakSet()
        self._count_finishes()

    def _count_finishes(self) -> None:
        """Every request the engine finishes goes into the Engine tab's latencies and its steps
        into its history (API ones included), whether or not a tab is open to read the engine:
        a finish listener, once per engine."""
        llm = self.llm
        if llm is None or llm in self._counted:
            return
        cursor = 0

        def on_finish(ev) -> None:      # the engine thread, holding its (reentrant) lock
            nonlocal cursor
            h = history_for(self)
            steps, cursor = llm.steps_since(cursor)
            h.fold_steps(steps)
            h.finish(ev)
        llm.finish_listeners.append(on_finish)
        self._counted.add(llm)

    def switch(self, choice: str) -> None:
        try:
            super().switch(choice)
        finally:        # the new engine, or the old one reloaded after a failed load
            self._count_finishes()

    def _forget_watched(self) -> None:
        for s in list(self.sessions.values()):
            s.watched = None

    # ---- sessions and requests ------------------------------------------------------------
    def session(self, key: str | None) -> Session:
        return self.sessions.setdefault(key or "anonymous", Session())

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

    # ---- model facts ----------------------------------------------------------------------
    def model_line(self) -> str:
        llm = self.llm
        dtype = str(llm.dtype).replace("torch.", "")
        line = (f"**{llm.model_name}** · {llm.architecture} · {format_params(llm.num_params)} "
                f"params · {dtype} · {llm.device} · TP {llm.tp_size} · "
                f"{llm.num_kv_blocks} KV blocks × {llm.block_size} tokens · "
                f"max {llm.max_model_len} tokens")
        if self.switching:
            line = f"Loading **{self.switching}** (replies wait) · was: " + line
        return line

    def is_demo(self) -> bool:
        """True for the bundled demo checkpoints (greedy defaults, task examples)."""
        path = Path(getattr(self.llm, "model_path", "") or "")
        return path.name.startswith("demo-qwen3") and path.resolve().parent == DEMO_DIR
