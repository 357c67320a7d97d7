"""The Engine tab's long memory: step history aggregated as it ages, and request latencies.

The engine keeps only its newest steps (`snap.steps`, a bounded ring); a burst's prefill is
gone from it within seconds. Each live tab folds every snapshot it reads into one
EngineTimeline per hub, keyed by step_id so each step is counted once: the last two minutes in
one-second buckets, older time in ten-second buckets, up to HISTORY_S.

Nor does it depend on a tab being open: the hub's engine finish listener (views/live.py) folds
the steps run since its last call (the engine keeps 256) and hands every finished request's
final event to `finish`, with the engine's own timings (time to first token and end to end
from its arrival, queueing included; time per output token over its decode).
"""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from engine.records import EngineSnapshot, StepTrace

HISTORY_S = 15 * 60          # the history reaches this far back
FINE_S = 120                 # the newest FINE_S seconds stay in 1-second buckets
COARSE = 10                  # older ones merge into COARSE-second buckets
LATENCY_WINDOW_S = 5 * 60    # percentiles over the requests finished this recently


@dataclass
class Bucket:
    """Steps that began in [t, t + width)."""
    t: float
    width: float
    steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    busy_s: float = 0.0       # the steps' own time (schedule + prepare + forward + sample)
    max_running: int = 0
    max_waiting: int = 0

    def add(self, s: StepTrace) -> None:
        self.steps += 1
        self.prefill_tokens += s.num_prefill_tokens
        self.decode_tokens += s.num_decode_tokens
        self.busy_s += s.t_schedule + s.t_prepare + s.t_forward + s.t_sample
        self.max_running = max(self.max_running, s.num_running)
        self.max_waiting = max(self.max_waiting, s.num_waiting)

    def merge(self, o: "Bucket") -> None:
        self.steps += o.steps
        self.prefill_tokens += o.prefill_tokens
        self.decode_tokens += o.decode_tokens
        self.busy_s += o.busy_s
        self.max_running = max(self.max_running, o.max_running)
        self.max_waiting = max(self.max_waiting, o.max_waiting)


@dataclass
class Finished:
    request_id: str
    end: float
    ttft_s: float | None      # None: it ended before its first token (an abort, a refusal)
    e2e_s: float
    tpot_s: float | None      # None: fewer than two output tokens


@dataclass
class EngineTimeline:
    buckets: deque = field(default_factory=deque)        # oldest first
    last_step_id: int = -1
    finished: deque = field(default_factory=lambda: deque(maxlen=20_000))
    lock: threading.Lock = field(default_factory=threading.Lock)

    def fold(self, snap: EngineSnapshot) -> None:
        """Add the snapshot's steps not folded yet (each step once)."""
        self.fold_steps(snap.steps)

    def fold_steps(self, steps: Sequence[StepTrace]) -> None:
        """Add the steps not folded yet (each step once, by step id), oldest first."""
        with self.lock:
            new = [s for s in steps if s.step_id > self.last_step_id]
            if steps and steps[-1].step_id < self.last_step_id:   # engine restarted
                new = list(steps)
            for s in new:
                self._add_step(s)
            if new:
                self.last_step_id = new[-1].step_id
                self._age(new[-1].wall_time)

    def finish(self, ev, now: float | None = None) -> None:
        """One request's final TokenEvent (on the engine thread: an append, nothing more)."""
        m = ev.metrics or {}
        n, decode_s = int(m.get("num_output_tokens") or 0), m.get("decode_s") or 0.0
        f = Finished(ev.request_id, time.time() if now is None else now, m.get("ttft_s"),
                     float(m.get("e2e_s") or 0.0), decode_s / (n - 1) if n > 1 else None)
        with self.lock:
            self.finished.append(f)

    def _add_step(self, s: StepTrace) -> None:
        t = float(s.wall_time)
        sec = float(int(t))
        if not self.buckets or self.buckets[-1].t + self.buckets[-1].width <= t:
            self.buckets.append(Bucket(sec, 1.0))
        self.buckets[-1].add(s)

    def _age(self, now: float) -> None:
        """Merge buckets older than FINE_S into COARSE-second ones; drop past HISTORY_S."""
        while self.buckets and self.buckets[0].t < now - HISTORY_S:
            self.buckets.popleft()
        out: list[Bucket] = []
        for b in self.buckets:
            if b.t < now - FINE_S and b.width < COARSE:
                start = float(int(b.t // COARSE) * COARSE)
                if out and out[-1].t == start and out[-1].width == COARSE:
                    out[-1].merge(b)
                    continue
                nb = Bucket(start, float(COARSE))
                nb.merge(b)
                out.append(nb)
            else:
                out.append(b)
        self.buckets = deque(out)

    # ---- read side ----------------------------------------------------------------------
    def series(self) -> list[Bucket]:
        with self.lock:
            return list(self.buckets)

    def rates(self, now: float, span_s: float = 60.0) -> tuple[float, float, float]:
        """(prefill tok/s, decode tok/s, busy seconds) over the steps of the last `span_s`
        seconds, per busy second: a burst a minute ago still reads as the burst's rate."""
        with self.lock:
            bs = [b for b in self.buckets if b.t + b.width >= now - span_s]
        busy = sum(b.busy_s for b in bs)
        if busy <= 0:
            return 0.0, 0.0, 0.0
        return (sum(b.prefill_tokens for b in bs) / busy,
                sum(b.decode_tokens for b in bs) / busy, busy)

    def latency(self, now: float, window_s: float = LATENCY_WINDOW_S) -> dict:
        """p50/p90/p99 (seconds) of TTFT, time per output token and end to end over the
        requests finished within `window_s`, with their count."""
        with self.lock:
            fin = [f for f in self.finished if f.end >= now - window_s]
        return {"requests": len(fin),
                "ttft": percentiles([f.ttft_s for f in fin if f.ttft_s is not None]),
                "tpot": percentiles([f.tpot_s for f in fin if f.tpot_s is not None]),
                "e2e": percentiles([f.e2e_s for f in fin])}


def percentiles(values: Sequence[float], qs: Sequence[float] = (50, 90, 99)
                ) -> list[float] | None:
    return [float(v) for v in np.percentile(values, qs)] if len(values) else None


_LOCK = threading.Lock()


def history_for(hub) -> EngineTimeline:
    """The hub's one EngineTimeline (a fresh one after a model switch)."""
    with _LOCK:
        h = getattr(hub, "_glassbox_engine_timeline", None)
        if h is None or h[0] != hub.generation:
            h = (hub.generation, EngineTimeline())
            hub._glassbox_engine_timeline = h
        return h[1]


def fold(hub, snap: EngineSnapshot) -> EngineTimeline:
    """Fold `snap` into the hub's history (every live tab calls this with what it read)."""
    h = history_for(hub)
    h.fold(snap)
    return h
