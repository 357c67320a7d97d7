"""Pure builders for the Engine tab's charts: batch timeline, step time split, CUDA graphs (or
the batch per step on the CPU), the step history and the latency table.

They return canvas chart specs (views/step_chart.py), not plotly figures: the tab redraws them
several times a second and a canvas drawing costs the page a few ms where a plotly re-layout
cost ~100 ms on two cores. Each point of a chart spans [lo, hi) on the x axis: a step is
[id - 0.5, id + 0.5), a history bucket its seconds."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from engine.records import StepEntries, StepTrace
from views.figures_common import DECODE_COLOUR, PHASE_COLOURS, PREFILL_COLOUR
from views.step_chart import empty_chart

STEP_WINDOW = 64          # steps shown; the x range is fixed to this many
MAX_TIMELINE_ROWS = 24    # most recent requests in the timeline
IDLE_GAP_S = 0.05         # a pause between two steps longer than this (past the step's own
                          # time) is idle time: the engine had nothing to run
GRAPH_COLOUR, EAGER_COLOUR, BATCH_COLOUR = "#59a14f", "#e15759", "#333333"
PREFILL_GRAPH_COLOUR = "#8cd17d"        # a lighter green: a graph too, by prompt tokens
CASCADE_COLOUR = "#b07aa1"              # rows that read a shared prefix once (cascade)
CASCADE_ROWS = "rows reading a shared prefix once"
ROW_PX = 18               # one timeline row per request


def step_seconds(s: StepTrace) -> float:
    return s.t_schedule + s.t_prepare + s.t_forward + s.t_sample


@dataclass
class StepStats:
    """Figures over the window of recent steps the Engine tab's plots show."""
    num_steps: int
    median_ms: float            # median step time (schedule + prepare + forward + sample)
    busy_s: float               # seconds the engine was running these steps (idle gaps out)
    decode_tok_s: float | None  # decode tokens per busy second
    prefill_tok_s: float | None


def step_stats(steps: Sequence[StepTrace], window: int = STEP_WINDOW) -> StepStats | None:
    """Median step time and token rates over the last `window` steps, counting busy time only:
    the time from one step to the next counts when the next began right after (within
    IDLE_GAP_S of this step's own time), else only this step's own time. So a burst followed by
    a minute of idling still reads as the burst's rate."""
    steps = list(steps)[-window:]
    if not steps:
        return None
    own = [step_seconds(s) for s in steps]
    busy = 0.0
    for i, s in enumerate(steps):
        gap = steps[i + 1].wall_time - s.wall_time if i + 1 < len(steps) else own[i]
        busy += gap if 0 <= gap <= own[i] + IDLE_GAP_S else own[i]
    dec = sum(s.num_decode_tokens for s in steps)
    pre = sum(s.num_prefill_tokens for s in steps)
    return StepStats(len(steps), 1e3 * float(np.median(own)), busy,
                     dec / busy if busy > 0 else None, pre / busy if busy > 0 else None)


def step_axis(steps: Sequence[StepTrace], window: int) -> dict:
    """The shared x axis of the step charts: the last `window` steps, fixed width."""
    ids = [s.step_id for s in steps]
    last = ids[-1] if ids else 0
    return {"lo": [i - 0.5 for i in ids], "hi": [i + 0.5 for i in ids], "values": ids,
            "range": [last - window + 0.5, last + 0.5], "name": "step", "title": "step",
            "int": True}


def series(name: str, colour: str, y: list, **extra) -> dict:
    return {"name": name, "colour": colour, "y": y, **extra}


def chart(title: str, legend: list, x: dict, panels: list, height: int) -> dict:
    return {"title": title, "legend": legend, "x": x, "panels": panels, "height": height}


# request id <-> a small integer, so a window's entries are numpy arrays; and each step's entries
# as such arrays, made once per step (a step's entries never change; the ring hands the same
# object out again). Both bounded: cleared together when the numbering grows past _MAX_NAMES.
_ORDINALS: dict[str, int] = {}
_NAMES: list[str] = []
_MAX_NAMES = 1 << 20
_COLUMNS: OrderedDict[int, tuple] = OrderedDict()    # id(entries) -> (entries, arrays)
_MAX_COLUMNS = 1024


def _ordinal(rid: str) -> int:
    n = _ORDINALS[rid] = len(_NAMES)
    _NAMES.append(rid)
    return n


def _step_columns(step: StepTrace) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(request ordinals, is prefill, tokens, start positions) of one step's entries."""
    entries = step.entries
    hit = _COLUMNS.get(id(entries))
    if hit is not None and hit[0] is entries:       # the same object: the id was not reused
        _COLUMNS.move_to_end(id(entries))
        return hit[1]
    c = StepEntries.of(entries)
    got = list(map(_ORDINALS.get, c.request_ids))    # known ids in one C-level pass
    if None in got:
        got = [o if o is not None else _ORDINALS.get(r) if r in _ORDINALS else _ordinal(r)
               for o, r in zip(got, c.request_ids)]
    arrays = (np.array(got, np.int64), np.fromiter(map("prefill".__eq__, c.kinds), bool,
                                                   len(c)).astype(np.int64),
              np.array(c.num_tokens, np.int64), np.array(c.start_pos, np.int64))
    _COLUMNS[id(entries)] = (entries, arrays)
    while len(_COLUMNS) > _MAX_COLUMNS:
        _COLUMNS.popitem(last=False)
    return arrays


def batch_timeline_figure(steps: Sequence[StepTrace], window: int = STEP_WINDOW) -> dict:
    """Top: prefill vs decode tokens per step. Bottom: which request ran in which step, and how."""
    title = "Batch timeline: tokens per step (top), requests in each step (below)"
    if not steps:
        return empty_chart("No engine steps yet", title)
    steps = list(steps)[-window:]
    if len(_NAMES) >= _MAX_NAMES:       # renumber from scratch, never within one window
        _ORDINALS.clear()
        _NAMES.clear()
        _COLUMNS.clear()
    cols = [_step_columns(s) for s in steps]
    ords = np.concatenate([c[0] for c in cols])
    at_step = np.repeat(np.arange(len(cols)), [len(c[0]) for c in cols])
    # rows: the newest MAX_TIMELINE_ROWS requests in order of first appearance
    uniq, first = np.unique(ords, return_index=True)
    shown = uniq[np.argsort(first, kind="stable")][-MAX_TIMELINE_ROWS:]
    rids = [_NAMES[o] for o in shown.tolist()]
    by_ord = np.argsort(shown)
    sorted_shown = shown[by_ord]
    where = np.minimum(np.searchsorted(sorted_shown, ords), max(len(shown) - 1, 0))
    hit = sorted_shown[where] == ords if len(shown) else np.zeros(len(ords), bool)
    # [step, row, kind (an index into "kinds"), tokens, start position]: numbers only, the
    # page writes the hover text ("prefill 8 tok @ 0"); made with numpy from columns cached
    # per step (16k entries a window at 256 requests: a Python pass over them was ~3 ms)
    cells = np.stack([at_step[hit], by_ord[where[hit]], np.concatenate([c[1] for c in cols])[hit],
                      np.concatenate([c[2] for c in cols])[hit],
                      np.concatenate([c[3] for c in cols])[hit]], axis=1).tolist()
    tokens = {"kind": "stack", "weight": 110, "y_title": "tokens", "int": True, "series": [
        series("prefill tokens", PREFILL_COLOUR, [s.num_prefill_tokens for s in steps]),
        series("decode tokens", DECODE_COLOUR, [s.num_decode_tokens for s in steps])]}
    requests = {"kind": "cells", "weight": max(60, ROW_PX * len(rids)), "y_title": "request",
                "rows": rids, "kinds": [["decode", DECODE_COLOUR], ["prefill", PREFILL_COLOUR]],
                "cells": cells}
    return chart(title, [["prefill", PREFILL_COLOUR, "fill"], ["decode", DECODE_COLOUR, "fill"]],
                 step_axis(steps, window), [tokens, requests],
                 height=max(300, ROW_PX * len(rids) + 230))


def step_time_figure(steps: Sequence[StepTrace], window: int = STEP_WINDOW) -> dict:
    """Where each step's time went: schedule / prepare / forward / sample, stacked, in ms."""
    if not steps:
        return empty_chart("No engine steps yet", "Step time")
    steps = list(steps)[-window:]
    stats = step_stats(steps, window)
    panel = {"kind": "stack", "y_title": "ms", "digits": 2, "series": [
        series(phase, colour, [1e3 * getattr(s, f"t_{phase}") for s in steps], unit=" ms")
        for phase, colour in PHASE_COLOURS.items()]}
    return chart(f"Step time split (median {stats.median_ms:.1f} ms over the last "
                 f"{stats.num_steps} steps)",
                 [[p, c, "fill"] for p, c in PHASE_COLOURS.items()], step_axis(steps, window),
                 [panel], height=290)


def cuda_graph_figure(steps: Sequence[StepTrace], window: int = STEP_WINDOW) -> dict:
    """Per step: the decode graph's batch bucket, or the prefill graph's token bucket (a step
    with prompt tokens: engine/prefill_graphs.py), or eager (red) with its tokens, and the
    requests in the batch."""
    if not steps:
        return empty_chart("No engine steps yet", "CUDA graphs")
    steps = list(steps)[-window:]
    graph = sum(s.graph_bucket is not None for s in steps)

    def bucket(s, prefill: bool) -> int:
        return s.graph_bucket if s.graph_bucket is not None and \
            bool(s.num_prefill_tokens) == prefill else 0
    panel = {"kind": "stack", "y_title": "batch / bucket", "int": True, "series": [
        series("decode graph (batch)", GRAPH_COLOUR, [bucket(s, False) for s in steps]),
        series("prefill graph (tokens)", PREFILL_GRAPH_COLOUR, [bucket(s, True) for s in steps]),
        series("eager (tokens)", EAGER_COLOUR,
               [0 if s.graph_bucket is not None else s.num_prefill_tokens + s.num_decode_tokens
                for s in steps])],
        "lines": [series("requests in batch", BATCH_COLOUR, [len(s.entries) for s in steps]),
                  _cascade_series(steps)]}
    return chart(f"CUDA graphs: {graph / len(steps):.0%} of recent steps replayed a graph"
                 + cascade_note(steps),
                 [["decode graph (batch)", GRAPH_COLOUR, "fill"],
                  ["prefill graph (tokens)", PREFILL_GRAPH_COLOUR, "fill"],
                  ["eager (tokens)", EAGER_COLOUR, "fill"],
                  ["requests in batch", BATCH_COLOUR, "line"], [CASCADE_ROWS, CASCADE_COLOUR, "dash"]],
                 step_axis(steps, window), [panel], height=290)


def _cascade_series(steps: Sequence[StepTrace]) -> dict:
    return series(CASCADE_ROWS, CASCADE_COLOUR, [s.cascade_rows for s in steps], dash=True)


def cascade_note(steps: Sequence[StepTrace]) -> str:
    """The title's account of cascade attention (engine/cascade.py) over the window: how many
    steps read a shared prefix once for all their rows, and the KV bytes they did not read."""
    used = [s for s in steps if s.cascade_rows]
    if not used:
        return ""
    saved = sum(s.kv_bytes_saved for s in used)
    return (f" · {len(used)} steps read a shared prefix once ({saved / 2**20:,.1f} MiB of KV "
            f"not re-read)")


def cpu_batch_figure(steps: Sequence[StepTrace], window: int = STEP_WINDOW) -> dict:
    """On the CPU, where CUDA graphs do not exist: what each step ran (requests in the batch,
    running and waiting), instead of a panel of 'eager' steps that could be nothing else."""
    if not steps:
        return empty_chart("No engine steps yet", "Batch per step")
    steps = list(steps)[-window:]
    panel = {"kind": "stack", "y_title": "requests", "int": True, "lines": [
        series("requests in batch", BATCH_COLOUR, [len(s.entries) for s in steps]),
        series("running", DECODE_COLOUR, [s.num_running for s in steps], dash=True),
        series("waiting", PREFILL_COLOUR, [s.num_waiting for s in steps], dash=True),
        _cascade_series(steps)]}
    return chart("Batch per step (CPU: no CUDA graphs, every step runs eagerly)"
                 + cascade_note(steps),
                 [["requests in batch", BATCH_COLOUR, "line"], ["running", DECODE_COLOUR, "dash"],
                  ["waiting", PREFILL_COLOUR, "dash"], [CASCADE_ROWS, CASCADE_COLOUR, "dash"]],
                 step_axis(steps, window), [panel], height=290)


def history_figure(buckets: Sequence, now: float, span_s: float = 15 * 60) -> dict:
    """Tokens per second over the last `span_s` seconds from the view's aggregated history
    (views/engine_timeline.py): 1-second buckets for the last two minutes, 10-second ones before."""
    title = "Engine history: tokens/s, last 15 min (older than 2 min: 10-s averages)"
    if not buckets:
        return empty_chart("No engine steps yet", title)
    # the span with data (at least a minute, at most span_s): a new server's first burst
    # is not squeezed into the right edge of an empty quarter hour
    x = {"lo": [round(b.t - now, 2) for b in buckets],
         "hi": [round(b.t + b.width - now, 2) for b in buckets],
         "values": [f"{now - b.t - b.width / 2:.0f} s ago" for b in buckets],
         "range": [-min(span_s, max(60.0, now - buckets[0].t)), 0], "name": "",
         "title": "seconds ago", "int": True}
    panel = {"kind": "stack", "y_title": "tok/s", "digits": 0, "series": [
        series("prefill tok/s", PREFILL_COLOUR, [b.prefill_tokens / b.width for b in buckets]),
        series("decode tok/s", DECODE_COLOUR, [b.decode_tokens / b.width for b in buckets])],
        "lines": [series("running", BATCH_COLOUR, [b.max_running for b in buckets],
                         right=True, width=1)]}
    return chart(title, [["prefill tok/s", PREFILL_COLOUR, "fill"],
                         ["decode tok/s", DECODE_COLOUR, "fill"],
                         ["running (right axis)", BATCH_COLOUR, "line"]], x, [panel], height=260)


def _ms(v: float) -> str:
    return f"{1e3 * v:.0f}" if v >= 0.01 else f"{1e3 * v:.1f}"


def latency_table(lat: dict, window_s: float) -> dict:
    """The latency panel: TTFT, time per output token and end-to-end p50 / p90 / p99, in ms."""
    title = f"Latency, last {window_s / 60:.0f} min"
    n = lat["requests"]
    note = (f"{n} request{'' if n == 1 else 's'} finished (every request the engine finished, "
            "the API's too, whether or not this tab was open); timed by the engine from each "
            "request's arrival, queueing included")
    if not lat["requests"]:
        return {"kind": "table", "title": title + ": none yet", "note": note}
    rows = [[name] + ([_ms(v) for v in lat[key]] if lat[key] else ["—"] * 3)
            for name, key in (("time to first token (ms)", "ttft"),
                              ("time per output token (ms)", "tpot"),
                              ("end to end (ms)", "e2e"))]
    return {"kind": "table", "title": title, "head": ["", "p50", "p90", "p99"], "rows": rows,
            "note": note}


def graphs_figure(snap):
    """CUDA graphs on the GPU; on the CPU (no graphs there) the batch of each step."""
    if str(snap.device).startswith("cpu"):
        return cpu_batch_figure(snap.steps)
    return cuda_graph_figure(snap.steps)
