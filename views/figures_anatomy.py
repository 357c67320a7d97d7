"""Pure plotly builders for the Anatomy tab: weights per part, one KV block's L × 2 regions,
bytes per tensor-parallel rank at each degree, depth vs width. Records in, figures out (the
records come from engine/anatomy; tests build them from tiny models)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import plotly.graph_objects as go

from engine.anatomy import KVDataPlane, ShapeRow, TPPlan, WeightBreakdown
from views.byte_ticks import linear_byte_axis, log_byte_axis
from views.figures_common import Figure, empty_figure, fmt_bytes, make_figure  # noqa: F401

GROUP_COLOURS = {
    "embedding": "#4e79a7", "attention": "#f28e2b", "norms": "#bab0ac", "mlp": "#59a14f",
    "router": "#e15759", "experts": "#76b7b2", "shared expert": "#edc948",
    "shared gate": "#b07aa1", "final norm": "#9c755f", "lm head": "#ff9da7",
}
MIN_VISIBLE = 0.006        # the narrowest share of the weights bar drawn (see weights_figure)
THIN_PER_LINE = 3          # too-thin parts named per line of the weights bar's note
K_COLOUR, V_COLOUR = "#4e79a7", "#f28e2b"
TOP_LEGEND = dict(orientation="h", y=1.02, x=1, xanchor="right", yanchor="bottom")


def fmt_count(n: float) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f}"


def _shade(hex_colour: str, t: float) -> str:
    """Mix a colour with white: t = 0 the colour, t = 1 white (layers shade from dark to light)."""
    r, g, b = (int(hex_colour[i:i + 2], 16) for i in (1, 3, 5))
    mix = [round(c + (255 - c) * t) for c in (r, g, b)]
    return "#" + "".join(f"{c:02x}" for c in mix)


def _figure(traces: list, title: str, **kw) -> Figure:
    """make_figure over graph-object traces: these figures are drawn once per model (not live),
    so plotly's validation and its magic underscores are worth their cost here. With a legend
    (the live figures have none)."""
    if "legend" in kw:
        kw["showlegend"] = True
    return make_figure([t.to_plotly_json() for t in traces], title, **kw)


# ---- weights ---------------------------------------------------------------------------------

def weights_figure(w: WeightBreakdown) -> Figure:
    """Bytes per part as one stacked bar (and, for MoE, the bytes one token reads)."""
    rows = ["all weights"] + (["read per token"] if w.active_params != w.total_params else [])
    traces, shown, thin = [], set(), []
    sum_bytes = w.total_params * w.elem_bytes
    # parts under MIN_VISIBLE of the bar (the norms: KiB beside MiB of matrices) are too thin
    # to see: they are named in a note under the axis, in their colours (arrows pointing at
    # them from above struck through each other's labels and the legend)
    for p in w.parts:
        if p.params == 0:
            continue
        colour = GROUP_COLOURS.get(p.group, "#888")
        shape = " + ".join("×".join(map(str, s)) for s in p.shapes)
        where = f"× {p.instances} layers" if p.layers else "once"
        values = [p.params * w.elem_bytes, p.active_params * w.elem_bytes][:len(rows)]
        if values[0] < MIN_VISIBLE * sum_bytes:
            thin.append(f'<span style="color:{colour}">{p.label}: {fmt_bytes(values[0])} '
                        f'({100 * values[0] / max(1, sum_bytes):.2g} %)</span>')
        traces.append(go.Bar(
            y=rows, x=values, orientation="h", name=p.group, legendgroup=p.group,
            showlegend=p.group not in shown, marker=dict(color=colour, line=dict(color="white",
                                                                              width=1)),
            customdata=[[p.label, shape, where, fmt_count(p.params), fmt_count(p.active_params),
                         fmt_bytes(p.params * w.elem_bytes)]] * len(rows),
            hovertemplate="<b>%{customdata[0]}</b> [%{customdata[1]}] %{customdata[2]}<br>"
                          "%{customdata[3]} params · %{customdata[5]}<br>"
                          "per token: %{customdata[4]}<extra>%{fullData.name}</extra>"))
        shown.add(p.group)
    title = (f"Weights: {fmt_count(w.total_params)} parameters = {fmt_bytes(w.total_bytes)} "
             f"as {w.dtype}" + (", embedding tied to the LM head" if w.tied else ""))
    if len(rows) > 1:
        title += f" · {fmt_count(w.active_params)} read per token"
    lines = [" · ".join(thin[i:i + THIN_PER_LINE]) for i in range(0, len(thin), THIN_PER_LINE)]
    note = ([dict(xref="paper", yref="paper", x=0, y=0, yshift=-26, xanchor="left",
                  yanchor="top", align="left", showarrow=False, font=dict(size=11),
                  text="Too thin to see: " + "<br>".join(lines))] if lines else [])
    return _figure(traces, title, uirevision="anatomy-weights",
                   height=130 + 40 * len(rows) + 16 * len(lines), annotations=note,
                   barmode="stack", legend=TOP_LEGEND,
                   margin=dict(l=110, r=20, t=72, b=34 + 16 * len(lines)),
                   # no axis title: every tick says its unit
                   xaxis=dict(rangemode="tozero", **linear_byte_axis(sum_bytes)),
                   yaxis=dict(autorange="reversed"))


# ---- KV cache data plane ---------------------------------------------------------------------

def kv_regions_figure(plane: KVDataPlane, block_id: int) -> Figure:
    """Top: the whole cache tensor as one address line, K slabs then V slabs (one per layer),
    with the block's 2L regions marked. Bottom: the regions as a K/V × layer grid."""
    try:
        regions = plane.regions(block_id)
    except ValueError as e:
        return empty_figure(str(e), "KV block regions")
    L, s1 = plane.num_layers, plane.byte_strides[1]
    traces, shapes = [], []
    for kv, which, colour in ((0, "K", K_COLOUR), (1, "V", V_COLOUR)):
        for layer in range(L):
            x0 = kv * plane.byte_strides[0] + layer * s1
            shapes.append(dict(type="rect", xref="x", yref="y", x0=x0, x1=x0 + s1, y0=-0.4,
                               y1=0.4, fillcolor=_shade(colour, 0.82), layer="below",
                               line=dict(color="white", width=1)))
    mark_w = max(plane.region_bytes, plane.total_bytes / 200)   # thin regions stay visible
    for r in regions:
        colour = K_COLOUR if r.which == "k" else V_COLOUR
        traces.append(go.Bar(
            x=[mark_w], base=[r.offset], y=["cache"], orientation="h", width=0.8,
            marker_color=_shade(colour, 0.5 * r.layer / max(L - 1, 1)), showlegend=False,
            xaxis="x", yaxis="y",
            hovertemplate=(f"{r.which.upper()} of layer {r.layer}<br>bytes [{r.offset:,}, "
                           f"{r.offset + r.nbytes:,})<extra></extra>")))
    z = [[0.0] * L, [1.0] * L]
    text = [[f"{regions[kv * L + l].offset:,}" for l in range(L)] for kv in (0, 1)]
    traces.append(go.Heatmap(
        z=z, x=[f"L{l}" for l in range(L)], y=["K", "V"], zmin=0, zmax=1, showscale=False,
        colorscale=[[0, K_COLOUR], [1, V_COLOUR]], xgap=3, ygap=3, text=text,
        texttemplate="%{text}" if L <= 16 else "", textfont=dict(color="white", size=10),
        xaxis="x2", yaxis="y2",
        hovertemplate="%{y} of layer %{x}<br>byte offset %{text}<br>"
                      f"{plane.region_bytes:,} bytes = {' × '.join(map(str, plane.shape[3:]))} "
                      f"× {plane.elem_bytes} B<extra></extra>"))
    return _figure(
        traces, f"Block {block_id}: {2 * L} regions of {fmt_bytes(plane.region_bytes)} "
                f"scattered through {fmt_bytes(plane.total_bytes)} (offsets in bytes)",
        uirevision="anatomy-kv-regions", height=330, shapes=shapes, barmode="overlay",
        xaxis=dict(range=[0, plane.total_bytes], title="byte address in the cache tensor",
                   anchor="y"),
        yaxis=dict(domain=[0.68, 1], showticklabels=False),
        xaxis2=dict(anchor="y2", title="layer"),
        yaxis2=dict(domain=[0, 0.45], autorange="reversed"))


# ---- tensor parallelism ----------------------------------------------------------------------

def tp_bytes_figure(plans: Sequence[TPPlan], running_tp: int) -> Figure:
    """Weights and KV cache per rank at each TP degree, against one GPU's budget."""
    if not plans:
        return empty_figure("No TP degrees to show", "Bytes per rank")
    x = [f"TP {p.tp}" + (" (running)" if p.tp == running_tp else "") for p in plans]
    ok = [p.possible for p in plans]
    weights = [p.weight_bytes_per_rank if o else 0 for p, o in zip(plans, ok)]
    kv = [p.ranks[0].layout.kv_cache_bytes if o and p.ranks else 0 for p, o in zip(plans, ok)]
    notes = [dict(x=xi, y=0.5, yref="paper", text="not possible:<br>" +
                  p.reason.split(";")[0].replace(" is not divisible", "<br>is not divisible"),
                  showarrow=False, font=dict(size=10, color="#d62728"))
             for xi, p in zip(x, plans) if not p.possible]
    budget = plans[0].budget_bytes
    traces = [
        go.Bar(x=x, y=weights, name="weights per rank", marker_color="#4e79a7",
               customdata=[fmt_bytes(b) for b in weights],
               hovertemplate="%{x}<br>weights %{customdata}<extra></extra>"),
        go.Bar(x=x, y=kv, name="KV cache per rank (this engine's size)",
               marker_color="#f28e2b", customdata=[fmt_bytes(b) for b in kv],
               hovertemplate="%{x}<br>KV cache %{customdata}<extra></extra>"),
        go.Scatter(x=x, y=[budget] * len(x), mode="lines", name="one GPU's budget",
                   line=dict(color="#d62728", dash="dash"),
                   hovertemplate=f"{fmt_bytes(plans[0].gpu_bytes)} × {plans[0].utilisation:g}"
                                 f" = {fmt_bytes(budget)}<extra></extra>"),
    ]
    top = max([budget] + [w + k for w, k in zip(weights, kv)])
    low = max(min([b for b in weights + kv if b > 0] or [1]) / 4, 1)
    return _figure(
        traces, f"What one rank holds at each degree (budget {fmt_bytes(plans[0].gpu_bytes)} "
                f"× {plans[0].utilisation:g} per GPU)",
        uirevision="anatomy-tp-bytes", height=330, barmode="stack", legend=TOP_LEGEND,
        annotations=notes, yaxis=dict(title="bytes", range=[math.log10(low), math.log10(top * 3)],
                                      **log_byte_axis(low, top * 3)))


# ---- depth vs width --------------------------------------------------------------------------

def depth_width_figure(rows: Sequence[ShapeRow]) -> Figure:
    """Layers vs hidden size; marker area grows with the parameter count; MoE in its own colour."""
    if not rows:
        return empty_figure("No shapes", "Depth vs width")
    traces = []
    biggest = max(r.total_params for r in rows)
    for kind, colour, symbol in (("dense", "#4e79a7", "circle"), ("MoE", "#e15759", "diamond")):
        sel = [r for r in rows if (r.arch.is_moe == (kind == "MoE")) and not r.loaded]
        if sel:
            traces.append(_shape_trace(sel, f"published {kind}", colour, symbol, biggest))
    loaded = [r for r in rows if r.loaded]
    if loaded:
        traces.append(_shape_trace(loaded, "loaded model (live)", "#2ca02c", "star", biggest))
    return _figure(
        traces, "Depth vs width: layers × hidden size (marker area ∝ parameters)",
        uirevision="anatomy-depth-width", height=380, legend=TOP_LEGEND,
        xaxis=dict(title="decoder layers (depth)", type="log"),
        yaxis=dict(title="hidden size (width)", type="log"))


def _shape_trace(rows, name, colour, symbol, biggest) -> go.Scatter:
    size = [10 + 40 * math.sqrt(r.total_params / biggest) for r in rows]
    info = [[fmt_count(r.total_params), fmt_count(r.active_params), r.arch.num_heads,
             r.arch.num_kv_heads, (f"{r.arch.num_experts} experts, top-{r.arch.top_k}"
                                   if r.arch.is_moe else f"MLP {r.arch.intermediate_size}")]
            for r in rows]
    return go.Scatter(
        x=[r.arch.num_layers for r in rows], y=[r.arch.hidden_size for r in rows],
        mode="markers+text", name=name, text=[r.name for r in rows], textposition="top center",
        textfont=dict(size=10), customdata=info,
        marker=dict(size=size, color=colour, symbol=symbol, opacity=0.75,
                    line=dict(color="white", width=1)),
        hovertemplate="<b>%{text}</b><br>%{x} layers × hidden %{y}<br>heads %{customdata[2]}"
                      " (KV %{customdata[3]}) · %{customdata[4]}<br>%{customdata[0]} params, "
                      "%{customdata[1]} per token<extra></extra>")


# ---- live numbers of the watched request's token ---------------------------------------------

@dataclass
class LiveToken:
    """One token of a watched request, read from its RequestTrace, for the token-path diagram."""
    request_id: str
    position: int
    token_id: int
    text: str
    norms: np.ndarray | None                         # [num_layers + 1]: embed, then each layer
    lens: list[tuple[str, float]] | None = None      # per layer: top next-token text and prob
    sampled: str | None = None                       # the token sampled after this position
    routed: list[tuple[int, list[int], list[float]]] | None = None   # (layer, experts, weights)


def live_token(trace, t: int, decode: Callable[[Sequence[int]], str]) -> LiveToken | None:
    """The numbers the probes recorded for token t of a trace (None when t is out of range or
    the token came from the prefix cache)."""
    ids = list(trace.prompt_token_ids) + list(trace.output_token_ids)
    if not 0 <= t < min(len(ids), len(trace.resid_norms)):
        return None
    if not np.isfinite(np.asarray(trace.resid_norms[t], dtype=float)).any():
        return None         # served by the prefix cache: nothing was computed for it here
    text = trace.token_texts[t] if t < len(trace.token_texts) else decode([ids[t]])
    live = LiveToken(trace.request_id, t, ids[t], text, np.asarray(trace.resid_norms[t]))
    step = next((s for s in trace.lens if s.position == t), None)
    if step is not None:
        live.lens = [(decode([int(step.top_ids[l, 0])]), float(step.top_probs[l, 0]))
                     for l in range(step.top_ids.shape[0])]
        live.sampled = decode([int(step.sampled_token)])
    if trace.router_topk_ids and t < len(trace.router_topk_ids):
        ids_t, w_t = trace.router_topk_ids[t], trace.router_topk_weights[t]
        live.routed = [(layer, [int(e) for e in ids_t[j]], [float(x) for x in w_t[j]])
                       for j, layer in enumerate(trace.moe_layers)]
    return live

