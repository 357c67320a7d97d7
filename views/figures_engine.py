"""Pure builders for the Engine tab: batch timeline, step time split, CUDA graphs, TP map."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from engine.records import RankLayout, StepTrace
from views.figures_common import (DECODE_COLOUR, PALETTE, PHASE_COLOURS, PREFILL_COLOUR,
                                  Figure, bar, empty_figure, fmt_bytes, heatmap, legend_title,
                                  make_figure, scatter)

STEP_WINDOW = 64          # steps shown; the x range is fixed to this many
MAX_TIMELINE_ROWS = 24    # most recent requests in the timeline
IDLE_GAP_S = 0.05         # a pause between two steps longer than this (past the step's own
                          # time) is idle time: the engine had nothing to run
GRAPH_COLOUR, EAGER_COLOUR = "#59a14f", "#e15759"


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


def int_axis(top: float, **extra) -> dict:
    """A count axis with whole-number ticks (about four of them) from 0."""
    top = max(1.0, float(top))
    raw = top / 4
    mag = 10 ** np.floor(np.log10(raw)) if raw >= 1 else 1
    dtick = max(1, int(next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)))
    return dict(tick0=0, dtick=dtick, rangemode="tozero", tickformat="d", **extra)


def _window(steps: Sequence[StepTrace], window: int) -> tuple[list[StepTrace], list[float]]:
    steps = list(steps)[-window:]
    last = steps[-1].step_id if steps else 0
    return steps, [last - window + 0.5, last + 0.5]


def batch_timeline_figure(steps: Sequence[StepTrace], window: int = STEP_WINDOW) -> Figure:
    """Top: prefill vs decode tokens per step. Bottom: which request ran in which step, and how."""
    if not steps:
        return empty_figure("No engine steps yet", "Batch timeline")
    steps, xrange = _window(steps, window)
    seen: dict[str, None] = {}          # insertion-ordered set: a list's `in` is quadratic
    for s in steps:                     # at 256 requests a step
        for e in s.entries:
            seen.setdefault(e.request_id)
    rids = list(seen)[-MAX_TIMELINE_ROWS:]
    row = {r: i for i, r in enumerate(rids)}
    x = [s.step_id for s in steps]
    z = np.full((len(rids), len(steps)), np.nan)                # 1 = decode, 2 = prefill
    text = np.full((len(rids), len(steps)), "", dtype=object)
    for j, s in enumerate(steps):
        for e in s.entries:
            if e.request_id in row:
                z[row[e.request_id], j] = 2 if e.kind == "prefill" else 1
                text[row[e.request_id], j] = f"{e.kind} {e.num_tokens} tok @ {e.start_pos}"
    prefill = [s.num_prefill_tokens for s in steps]
    decode = [s.num_decode_tokens for s in steps]
    # stacked step-shaped areas: one SVG path per series, where bars cost one per step
    traces = [
        scatter(x=x, y=prefill, name="prefill tokens", mode="lines", stackgroup="tok",
                   line=dict(color=PREFILL_COLOUR, width=1, shape="hv"),
                   xaxis="x", yaxis="y", hovertemplate="step %{x}: %{y} prefill<extra></extra>"),
        scatter(x=x, y=decode, name="decode tokens", mode="lines", stackgroup="tok",
                   line=dict(color=DECODE_COLOUR, width=1, shape="hv"),
                   xaxis="x", yaxis="y", hovertemplate="step %{x}: %{y} decode<extra></extra>"),
        heatmap(z=z, x=x, y=rids, zmin=1, zmax=2, showscale=False, xgap=1, ygap=1,
                   colorscale=[[0, DECODE_COLOUR], [0.5, DECODE_COLOUR], [0.5, PREFILL_COLOUR],
                               [1, PREFILL_COLOUR]], xaxis="x", yaxis="y2",
                   customdata=text,
                   hovertemplate="step %{x} · %{y}<br>%{customdata}<extra></extra>"),
    ]
    # bars on top (y), one row per request below (y2), sharing the step axis
    return make_figure(
        traces, legend_title("Batch timeline: tokens per step (top), requests in each step "
                             "(below)", {"prefill": PREFILL_COLOUR, "decode": DECODE_COLOUR}),
        uirevision="engine-timeline", height=max(340, 18 * len(rids) + 240),
        # the left margin fits the longest request id: ids are never cut ("chatcmpl-5df0d9a-5")
        margin=dict(l=min(280, 40 + 7 * max(len(r) for r in rids)) if rids else 70, r=20, t=62,
                    b=40),
        xaxis=dict(range=xrange, title="step", anchor="y2", tickformat="d"),
        yaxis=int_axis(max(p + d for p, d in zip(prefill, decode)), domain=[0.68, 1],
                       title="tokens"),
        yaxis2=dict(domain=[0, 0.62], title="request", type="category", autorange="reversed"))


def step_time_figure(steps: Sequence[StepTrace], window: int = STEP_WINDOW) -> Figure:
    """Where each step's time went: schedule / prepare / forward / sample, stacked, in ms."""
    if not steps:
        return empty_figure("No engine steps yet", "Step time")
    steps, xrange = _window(steps, window)
    x = [s.step_id for s in steps]
    traces = [scatter(x=x, y=[1e3 * getattr(s, f"t_{phase}") for s in steps], name=phase,
                         mode="lines", stackgroup="ms", line=dict(color=colour, width=1, shape="hv"),
                         hovertemplate=f"step %{{x}}<br>{phase} %{{y:.2f}} ms<extra></extra>")
              for phase, colour in PHASE_COLOURS.items()]
    stats = step_stats(steps, window)
    return make_figure(
        traces, legend_title(f"Step time split (median {stats.median_ms:.1f} ms over the last "
                             f"{stats.num_steps} steps)", PHASE_COLOURS),
        uirevision="engine-steptime", height=290, margin=dict(l=60, r=20, t=62, b=40),
        xaxis=dict(title="step", range=xrange, tickformat="d"),
        yaxis=dict(title="ms", rangemode="tozero"))


def cuda_graph_figure(steps: Sequence[StepTrace], window: int = STEP_WINDOW) -> Figure:
    """Per step: the CUDA-graph batch bucket replayed, or eager (red) — with the batch size."""
    if not steps:
        return empty_figure("No engine steps yet", "CUDA graphs")
    steps, xrange = _window(steps, window)
    graph = [s for s in steps if s.graph_bucket is not None]
    eager = [s for s in steps if s.graph_bucket is None]
    x = [s.step_id for s in steps]
    # one path per series (a gap where the other kind ran), where bars cost one per step
    traces = [
        scatter(x=x, y=[s.graph_bucket for s in steps], name="graph bucket", mode="lines",
                   fill="tozeroy", connectgaps=False,
                   line=dict(color=GRAPH_COLOUR, width=1, shape="hv"),
                   hovertemplate="step %{x}<br>graph bucket %{y}<extra></extra>"),
        scatter(x=x, y=[None if s.graph_bucket is not None else
                           s.num_prefill_tokens + s.num_decode_tokens for s in steps],
                   name="eager (tokens)", fill="tozeroy", connectgaps=False,
                   # isolated eager steps (prefills between graph replays) need a marker
                   mode="lines+markers" if len(eager) < 16 else "lines",
                   marker=dict(size=5, color=EAGER_COLOUR),
                   line=dict(color=EAGER_COLOUR, width=1, shape="hv"),
                   hovertemplate="step %{x}<br>eager, %{y} tokens<extra></extra>"),
        scatter(x=x, y=[len(s.entries) for s in steps], mode="lines",
                   name="requests in batch", line=dict(color="#333", width=1.5, shape="hv")),
    ]
    share = len(graph) / len(steps)
    top = max([s.graph_bucket or 0 for s in graph] + [len(s.entries) for s in steps] +
              [s.num_prefill_tokens + s.num_decode_tokens for s in eager])
    return make_figure(
        traces, legend_title(f"CUDA graphs: {share:.0%} of recent steps replayed a graph",
                             {"graph bucket": GRAPH_COLOUR, "eager (tokens)": EAGER_COLOUR,
                              "requests in batch": "#333"}),
        uirevision="engine-graphs", height=290, margin=dict(l=60, r=20, t=62, b=40),
        xaxis=dict(title="step", range=xrange, tickformat="d"),
        yaxis=int_axis(top, title="batch / bucket"))


def tp_map_figure(tp_layout: Sequence[RankLayout], num_heads: int, num_kv_heads: int
                  ) -> Figure:
    """Which rank holds which query heads, KV heads and MLP/expert slice."""
    if not tp_layout:
        return empty_figure("No tensor-parallel layout reported", "TP map")
    ranks = [f"rank {r.rank}" for r in tp_layout]
    traces = []
    for r in tp_layout:
        colour = PALETTE[r.rank % len(PALETTE)]
        hover = (f"rank {r.rank}<br>KV cache {fmt_bytes(r.kv_cache_bytes)}"
                 f"<br>vocab [{r.vocab_slice[0]}, {r.vocab_slice[1]})")
        for axis, heads in (("", r.q_heads), ("2", r.kv_heads)):
            traces.append(scatter(
                x=heads, y=[f"rank {r.rank}"] * len(heads), mode="markers", showlegend=False,
                marker=dict(symbol="square", size=14, color=colour), xaxis=f"x{axis}",
                yaxis=f"y{axis}", hovertemplate=f"head %{{x}}<br>{hover}<extra></extra>"))
        sl = r.expert_slice or r.mlp_slice
        if sl is not None:
            what = "each expert" if r.expert_slice else "MLP"
            traces.append(bar(
                y=[f"rank {r.rank}"], x=[sl[1] - sl[0]], base=[sl[0]], orientation="h",
                marker_color=colour, showlegend=False, xaxis="x3", yaxis="y3",
                hovertemplate=f"[{sl[0]}, {sl[1]}) of {what}<extra></extra>"))
    cat = dict(type="category", categoryorder="array", categoryarray=ranks,
               autorange="reversed")
    # three stacked panels laid out by hand: query heads, KV heads, intermediate slices
    panels = [(0.78, 1.0), (0.42, 0.60), (0.0, 0.20)]   # gaps leave room for tick labels
    titles = ["query heads", "KV heads", "MLP / expert intermediate slice"]
    notes = [dict(text=t, x=0.5, y=hi + 0.02, xref="paper", yref="paper", showarrow=False,
                  xanchor="center", yanchor="bottom", font=dict(size=12))
             for t, (_, hi) in zip(titles, panels)]
    return make_figure(
        traces, f"Tensor-parallel map ({len(tp_layout)} rank{'s' if len(ranks) > 1 else ''})",
        uirevision="engine-tp", height=max(340, 3 * 34 * len(ranks) + 240), annotations=notes,
        margin=dict(l=70, r=20, t=50, b=40),
        xaxis=dict(range=[-0.5, max(num_heads, 1) - 0.5], anchor="y",
                   dtick=1 if num_heads <= 32 else None),
        yaxis=dict(domain=panels[0], **cat),
        xaxis2=dict(range=[-0.5, max(num_kv_heads, 1) - 0.5], anchor="y2",
                    dtick=1 if num_kv_heads <= 32 else None),
        yaxis2=dict(domain=panels[1], **cat),
        xaxis3=dict(title="intermediate dim", anchor="y3"),
        yaxis3=dict(domain=panels[2], **cat))


def cpu_batch_figure(steps: Sequence[StepTrace], window: int = STEP_WINDOW) -> Figure:
    """On the CPU, where CUDA graphs do not exist: what each step ran (requests in the batch,
    prefill and decode tokens), instead of a panel of 'eager' steps that could be nothing else."""
    if not steps:
        return empty_figure("No engine steps yet", "Batch per step")
    steps, xrange = _window(steps, window)
    x = [s.step_id for s in steps]
    traces = [
        scatter(x=x, y=[len(s.entries) for s in steps], mode="lines", name="requests in batch",
                line=dict(color="#333", width=1.5, shape="hv"),
                hovertemplate="step %{x}<br>%{y} requests<extra></extra>"),
        scatter(x=x, y=[s.num_running for s in steps], mode="lines", name="running",
                line=dict(color=DECODE_COLOUR, width=1, shape="hv", dash="dot"),
                hovertemplate="step %{x}<br>%{y} running<extra></extra>"),
        scatter(x=x, y=[s.num_waiting for s in steps], mode="lines", name="waiting",
                line=dict(color=PREFILL_COLOUR, width=1, shape="hv", dash="dot"),
                hovertemplate="step %{x}<br>%{y} waiting<extra></extra>"),
    ]
    top = max([len(s.entries) for s in steps] + [s.num_running + s.num_waiting for s in steps])
    return make_figure(
        traces, legend_title("Batch per step (CPU: no CUDA graphs — each step runs eagerly, "
                             "one at a time)", {"requests in batch": "#333",
                                               "running": DECODE_COLOUR,
                                               "waiting": PREFILL_COLOUR}),
        uirevision="engine-graphs", height=290, margin=dict(l=60, r=20, t=62, b=40),
        xaxis=dict(title="step", range=xrange, tickformat="d"),
        yaxis=int_axis(top, title="requests"))


def history_figure(buckets: Sequence, now: float, span_s: float = 15 * 60) -> Figure:
    """Tokens per second over the last `span_s` seconds from the view's aggregated history
    (views/step_history.py): 1-second buckets for the last two minutes, 10-second ones before."""
    title = "Engine history: tokens/s, last 15 min (older than 2 min: 10-s averages)"
    if not buckets:
        return empty_figure("No engine steps yet", title)
    x = [round(b.t + b.width / 2 - now, 1) for b in buckets]
    pre = [b.prefill_tokens / b.width for b in buckets]
    dec = [b.decode_tokens / b.width for b in buckets]
    traces = [
        scatter(x=x, y=pre, name="prefill tok/s", mode="lines", stackgroup="tok",
                line=dict(color=PREFILL_COLOUR, width=1, shape="hv"),
                hovertemplate="%{x:.0f} s: %{y:.0f} prefill tok/s<extra></extra>"),
        scatter(x=x, y=dec, name="decode tok/s", mode="lines", stackgroup="tok",
                line=dict(color=DECODE_COLOUR, width=1, shape="hv"),
                hovertemplate="%{x:.0f} s: %{y:.0f} decode tok/s<extra></extra>"),
        scatter(x=x, y=[b.max_running for b in buckets], name="running", mode="lines",
                line=dict(color="#333", width=1, shape="hv"), yaxis="y2",
                hovertemplate="%{x:.0f} s: %{y} running<extra></extra>"),
    ]
    return make_figure(
        traces, legend_title(title, {"prefill tok/s": PREFILL_COLOUR,
                                     "decode tok/s": DECODE_COLOUR, "running (right)": "#333"}),
        uirevision="engine-history", height=260, margin=dict(l=60, r=50, t=62, b=40),
        # the span with data (at least a minute, at most span_s): a new server's first burst
        # is not squeezed into the right edge of an empty quarter hour
        xaxis=dict(title="seconds ago",
                   range=[-min(span_s, max(60.0, now - buckets[0].t)), 0]),
        yaxis=dict(title="tok/s", rangemode="tozero"),
        yaxis2=dict(overlaying="y", side="right", rangemode="tozero", tickformat="d",
                    showgrid=False, title="running"))


def _ms(v: float) -> str:
    return f"{1e3 * v:.0f}" if v >= 0.01 else f"{1e3 * v:.1f}"


def latency_markdown(lat: dict, window_s: float) -> str:
    """The latency panel: TTFT, inter-token and end-to-end p50 / p90 / p99, in ms."""
    head = (f"**Latency, last {window_s / 60:.0f} min** ({lat['requests']} requests finished, "
            f"{lat['tokens']} token gaps; measured in engine steps from each request's first "
            "scheduled step, queueing before it not included)")
    if not lat["requests"] and not lat["tokens"]:
        return head + ": none yet."
    rows = ["| | p50 | p90 | p99 |", "| --- | --- | --- | --- |"]
    for name, key in (("time to first token (ms)", "ttft"), ("inter-token (ms)", "itl"),
                      ("end to end (ms)", "e2e")):
        p = lat[key]
        rows.append(f"| {name} | " + (" | ".join(_ms(v) for v in p) if p else "— | — | —")
                    + " |")
    return head + "\n\n" + "\n".join(rows)
