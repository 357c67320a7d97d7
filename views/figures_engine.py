"""Pure builders for the Engine tab: batch timeline, step time split, CUDA graphs, TP map."""
from __future__ import annotations

from typing import Sequence

import numpy as np
import plotly.graph_objects as go

from engine.probes.snapshot import RankLayout, StepTrace
from views.figures_common import (DECODE_COLOUR, PALETTE, PHASE_COLOURS, PREFILL_COLOUR,
                                  empty_figure, make_figure)

STEP_WINDOW = 64          # steps shown; the x range is fixed to this many
MAX_TIMELINE_ROWS = 24    # most recent requests in the timeline
TOP_LEGEND = dict(orientation="h", y=1.02, x=1, xanchor="right", yanchor="bottom")


def _window(steps: Sequence[StepTrace], window: int) -> tuple[list[StepTrace], list[float]]:
    steps = list(steps)[-window:]
    last = steps[-1].step_id if steps else 0
    return steps, [last - window + 0.5, last + 0.5]


def batch_timeline_figure(steps: Sequence[StepTrace], window: int = STEP_WINDOW) -> go.Figure:
    """Top: prefill vs decode tokens per step. Bottom: which request ran in which step, and how."""
    if not steps:
        return empty_figure("No engine steps yet", "Batch timeline")
    steps, xrange = _window(steps, window)
    rids: list[str] = []
    for s in steps:
        for e in s.entries:
            if e.request_id not in rids:
                rids.append(e.request_id)
    rids = rids[-MAX_TIMELINE_ROWS:]
    row = {r: i for i, r in enumerate(rids)}
    x = [s.step_id for s in steps]
    z = np.full((len(rids), len(steps)), np.nan)                # 1 = decode, 2 = prefill
    text = np.full((len(rids), len(steps)), "", dtype=object)
    for j, s in enumerate(steps):
        for e in s.entries:
            if e.request_id in row:
                z[row[e.request_id], j] = 2 if e.kind == "prefill" else 1
                text[row[e.request_id], j] = f"{e.kind} {e.num_tokens} tok @ {e.start_pos}"
    traces = [
        go.Bar(x=x, y=[s.num_prefill_tokens for s in steps], name="prefill tokens",
               marker_color=PREFILL_COLOUR, xaxis="x", yaxis="y"),
        go.Bar(x=x, y=[s.num_decode_tokens for s in steps], name="decode tokens",
               marker_color=DECODE_COLOUR, xaxis="x", yaxis="y"),
        go.Heatmap(z=z, x=x, y=rids, zmin=1, zmax=2, showscale=False, xgap=1, ygap=1,
                   colorscale=[[0, DECODE_COLOUR], [0.5, DECODE_COLOUR], [0.5, PREFILL_COLOUR],
                               [1, PREFILL_COLOUR]], xaxis="x", yaxis="y2",
                   customdata=text,
                   hovertemplate="step %{x} · %{y}<br>%{customdata}<extra></extra>"),
    ]
    # bars on top (y), one row per request below (y2), sharing the step axis
    return make_figure(
        traces, "Batch timeline: prefill (orange) and decode (blue) per step",
        uirevision="engine-timeline", height=max(320, 18 * len(rids) + 220), barmode="stack",
        legend=TOP_LEGEND, xaxis=dict(range=xrange, title="step", anchor="y2"),
        yaxis=dict(domain=[0.68, 1], title="tokens"),
        yaxis2=dict(domain=[0, 0.62], title="request", type="category", autorange="reversed"))


def step_time_figure(steps: Sequence[StepTrace], window: int = STEP_WINDOW) -> go.Figure:
    """Where each step's time went: schedule / prepare / forward / sample, stacked, in ms."""
    if not steps:
        return empty_figure("No engine steps yet", "Step time")
    steps, xrange = _window(steps, window)
    x = [s.step_id for s in steps]
    traces = [go.Bar(x=x, y=[1e3 * getattr(s, f"t_{phase}") for s in steps], name=phase,
                     marker_color=colour,
                     hovertemplate=f"step %{{x}}<br>{phase} %{{y:.2f}} ms<extra></extra>")
              for phase, colour in PHASE_COLOURS.items()]
    total = [1e3 * (s.t_schedule + s.t_prepare + s.t_forward + s.t_sample) for s in steps]
    return make_figure(
        traces, f"Step time split (median {float(np.median(total)):.1f} ms/step)",
        uirevision="engine-steptime", height=280, barmode="stack", legend=TOP_LEGEND,
        xaxis=dict(title="step", range=xrange), yaxis=dict(title="ms", rangemode="tozero"))


def cuda_graph_figure(steps: Sequence[StepTrace], window: int = STEP_WINDOW) -> go.Figure:
    """Per step: the CUDA-graph batch bucket replayed, or eager (red) — with the batch size."""
    if not steps:
        return empty_figure("No engine steps yet", "CUDA graphs")
    steps, xrange = _window(steps, window)
    graph = [s for s in steps if s.graph_bucket is not None]
    eager = [s for s in steps if s.graph_bucket is None]
    traces = [
        go.Bar(x=[s.step_id for s in graph], y=[s.graph_bucket for s in graph],
               name="graph bucket", marker_color="#59a14f",
               hovertemplate="step %{x}<br>graph bucket %{y}<extra></extra>"),
        go.Bar(x=[s.step_id for s in eager],
               y=[s.num_prefill_tokens + s.num_decode_tokens for s in eager],
               name="eager (tokens)", marker_color="#e15759",
               hovertemplate="step %{x}<br>eager, %{y} tokens<extra></extra>"),
        go.Scatter(x=[s.step_id for s in steps], y=[len(s.entries) for s in steps],
                   mode="markers", name="requests in batch", marker=dict(color="#333", size=5)),
    ]
    share = len(graph) / len(steps)
    return make_figure(
        traces, f"CUDA graphs: {share:.0%} of recent steps replayed a graph",
        uirevision="engine-graphs", height=260, barmode="overlay", legend=TOP_LEGEND,
        xaxis=dict(title="step", range=xrange),
        yaxis=dict(title="batch / bucket", rangemode="tozero"))


def tp_map_figure(tp_layout: Sequence[RankLayout], num_heads: int, num_kv_heads: int
                  ) -> go.Figure:
    """Which rank holds which query heads, KV heads and MLP/expert slice."""
    if not tp_layout:
        return empty_figure("No tensor-parallel layout reported", "TP map")
    ranks = [f"rank {r.rank}" for r in tp_layout]
    traces = []
    for r in tp_layout:
        colour = PALETTE[r.rank % len(PALETTE)]
        hover = (f"rank {r.rank}<br>KV cache {r.kv_cache_bytes / 2**20:.1f} MiB"
                 f"<br>vocab [{r.vocab_slice[0]}, {r.vocab_slice[1]})")
        for axis, heads in (("", r.q_heads), ("2", r.kv_heads)):
            traces.append(go.Scatter(
                x=heads, y=[f"rank {r.rank}"] * len(heads), mode="markers", showlegend=False,
                marker=dict(symbol="square", size=14, color=colour), xaxis=f"x{axis}",
                yaxis=f"y{axis}", hovertemplate=f"head %{{x}}<br>{hover}<extra></extra>"))
        sl = r.expert_slice or r.mlp_slice
        if sl is not None:
            what = "each expert" if r.expert_slice else "MLP"
            traces.append(go.Bar(
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
