"""Pure builders for the Layers tab: residual norms, logit lens, attention heads, MoE routing."""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import plotly.graph_objects as go

from engine.probes.trace import AttentionStep, RequestTrace
from views.figures_common import (DECODE_COLOUR, PREFILL_COLOUR, empty_figure, hspan,
                                  make_figure, short_text, sqrt_prob_colorbar, vline, vspan)

Decode = Callable[[Sequence[int]], str]
MAX_LENS_STEPS = 32        # lens columns shown around the chosen token (hover text is costly)
MAX_LABELLED_TOKENS = 48   # past this, token axes show positions instead of token text
CHOSEN = "#e15759"         # outline of the scrubbed token / chosen head


def prob_ceiling(peak: float) -> float:
    """A y-axis top from a few fixed steps, so the axis only moves when the peak crosses one."""
    for top in (0.05, 0.1, 0.25, 0.5, 1.0):
        if peak <= top:
            return top
    return 1.0


def _token_label(texts: Sequence[str], i: int) -> str:
    return short_text(texts[i]) if i < len(texts) else "?"


def _token_axis(texts: Sequence[str], n: int, **extra) -> dict:
    """Tick labels with token text when they fit, plain positions otherwise."""
    if n <= MAX_LABELLED_TOKENS:
        return dict(tickmode="array", tickvals=list(range(n)),
                    ticktext=[_token_label(texts, i) for i in range(n)], tickangle=-60, **extra)
    return dict(tickmode="auto", **extra)


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) spans where `mask` is True."""
    edges = np.diff(np.concatenate([[0], mask.astype(np.int8), [0]]))
    return list(zip(np.flatnonzero(edges == 1).tolist(), np.flatnonzero(edges == -1).tolist()))


def norms_figure(trace: RequestTrace, token: int | None = None) -> go.Figure:
    """Residual-stream L2 norm, layer × token; prompt/output boundary and chosen token marked."""
    norms = trace.norms()                                     # [T, num_layers + 1]
    if len(norms) == 0:
        return empty_figure("No tokens processed yet", "Residual norms (layer × token)")
    t = len(norms)
    n_prompt = min(len(trace.prompt_token_ids), t)
    cached = np.isnan(norms).all(axis=1)      # prefix-cache hits: never computed for this request
    # colour range from the prompt (fixed once prefill ran), clipped so an attention-sink
    # token's huge norm does not wash out the rest
    ref = norms[:n_prompt] if n_prompt and not cached[:n_prompt].all() else norms
    if np.isnan(ref).all():
        zmin, zmax = 0.0, 1.0
    else:
        zmin, zmax = float(np.nanmin(ref)), float(np.nanpercentile(ref, 99))
    if not zmax > zmin:
        zmax = zmin + 1.0
    y = ["embed"] + [f"L{i}" for i in range(norms.shape[1] - 1)]
    texts = np.array([_token_label(trace.token_texts, i) for i in range(t)], dtype=object)
    shapes, notes = [], []
    for start, end in _runs(cached):
        shapes.append(vspan(start - 0.5, end - 0.5, "#adb5bd", fill=True))
        notes.append(dict(text="prefix cache: not recomputed", x=start - 0.5, y=1, xref="x",
                          yref="paper", xanchor="left", yanchor="top", showarrow=False,
                          font=dict(size=11)))
    if 0 < n_prompt < t:
        shapes.append(vline(n_prompt - 0.5, "white"))
    if token is not None and 0 <= token < t:
        shapes.append(vspan(token - 0.5, token + 0.5, CHOSEN))
    heat = go.Heatmap(
        z=norms.T, x=list(range(t)), y=y, zmin=zmin, zmax=zmax, colorscale="Viridis",
        customdata=np.tile(texts, (len(y), 1)), colorbar=dict(title="‖resid‖"),
        hovertemplate="token %{x} “%{customdata}”<br>%{y}<br>norm %{z:.3g}<extra></extra>")
    return make_figure(
        [heat], "Residual norms (layer × token)", uirevision=f"norms-{trace.request_id}",
        height=max(260, 14 * len(y) + 140), shapes=shapes, annotations=notes,
        xaxis=_token_axis(trace.token_texts, t, title="token position",
                          range=[-0.5, max(t, 16) - 0.5]),
        yaxis=dict(title="layer"))


def _lens_window(trace: RequestTrace, token: int | None) -> list[int]:
    """Indices into trace.lens to show: the newest steps, or those around the chosen token."""
    n = len(trace.lens)
    centre = n - 1
    if token is not None:
        idx = [i for i, s in enumerate(trace.lens) if s.position == token]
        centre = idx[0] if idx else centre
    lo = max(0, min(centre - MAX_LENS_STEPS // 2, n - MAX_LENS_STEPS))
    return list(range(lo, min(n, lo + MAX_LENS_STEPS)))


def logit_lens_figure(trace: RequestTrace, decode: Decode, token: int | None = None
                      ) -> go.Figure:
    """Layer × generated token: each layer's top-1 prediction (text) and its probability."""
    if not trace.lens:
        return empty_figure("No generated tokens yet", "Logit lens (layer × step)")
    steps = [trace.lens[i] for i in _lens_window(trace, token)]
    num_layers = steps[0].top_ids.shape[0]
    z = np.stack([s.top_probs[:, 0] for s in steps], axis=1)          # [layers, steps]
    top_text = [[short_text(decode([int(s.top_ids[l, 0])]), 8) for s in steps]
                for l in range(num_layers)]
    hover = [[("<br>".join(f"{decode([int(i)])!r} {p:.2f}"
                           for i, p in zip(s.top_ids[l], s.top_probs[l]))
               + f"<br>sampled rank {int(s.sampled_rank[l])}, p={float(s.sampled_prob[l]):.2f}"
               + f"<br>entropy {float(s.entropy[l]):.2f} nats") for s in steps]
             for l in range(num_layers)]
    x = [f"{s.position + 1}: {short_text(decode([s.sampled_token]), 8)}" for s in steps]
    heat = go.Heatmap(
        z=z, x=x, y=[f"L{l}" for l in range(num_layers)], zmin=0, zmax=1,
        colorscale="Blues", text=top_text, texttemplate="%{text}",
        textfont=dict(size=10), customdata=hover, colorbar=dict(title="top-1 p"),
        hovertemplate="%{y} → next token %{x}<br>%{customdata}<extra></extra>")
    shapes = [vspan(j - 0.5, j + 0.5, CHOSEN) for j, s in enumerate(steps)
              if token is not None and s.position == token]
    return make_figure(
        [heat], "Logit lens: each layer's top prediction", uirevision=f"lens-{trace.request_id}",
        height=max(260, 18 * num_layers + 160), shapes=shapes,
        xaxis=dict(title="generated token (position: sampled text)", type="category",
                   tickangle=-60),
        yaxis=dict(title="layer"))


def attention_step_for(trace: RequestTrace, token: int | None) -> AttentionStep | None:
    """The captured attention row for `token`, else the latest one at or before it."""
    if not trace.attention:
        return None
    if token is None:
        return trace.attention[-1]
    before = [s for s in trace.attention if s.position <= token]
    return before[-1] if before else trace.attention[0]


def attention_heads_figure(step: AttentionStep, layer: int, token_texts: Sequence[str],
                           head: int | None = None, request_id: str = "") -> go.Figure:
    """One row per head: the query token's attention over its context (sqrt colour scale)."""
    if layer not in step.layers:
        return empty_figure(f"Layer {layer} was not captured", "Attention heads")
    probs = step.probs[step.layers.index(layer)]                       # [H, ctx]
    h, ctx = probs.shape
    texts = np.array([_token_label(token_texts, i) for i in range(ctx)], dtype=object)
    heat = go.Heatmap(
        z=np.sqrt(np.clip(probs, 0, 1)), x=list(range(ctx)), y=[f"h{i}" for i in range(h)],
        zmin=0, zmax=1, colorscale="Magma", reversescale=True,
        customdata=np.stack([np.tile(texts, (h, 1)), probs.round(4).astype(object)], -1),
        colorbar=sqrt_prob_colorbar(),
        hovertemplate="%{y} → key %{x} “%{customdata[0]}”<br>p=%{customdata[1]}<extra></extra>")
    shapes = [hspan(head - 0.5, head + 0.5, "#2ca02c")] if head is not None and 0 <= head < h \
        else []
    qtext = _token_label(token_texts, step.position)
    return make_figure(
        [heat], f"Layer {layer}: attention of token {step.position} “{qtext}”",
        uirevision=f"heads-{request_id}-{layer}", height=max(240, 16 * h + 150), shapes=shapes,
        xaxis=_token_axis(token_texts, ctx, title="key position"),
        yaxis=dict(title="head", autorange="reversed"))


def attention_row_figure(step: AttentionStep, layer: int, head: int,
                         token_texts: Sequence[str], request_id: str = "") -> go.Figure:
    """The chosen head's row labelled with token text, and its mass per physical KV block."""
    if layer not in step.layers:
        return empty_figure(f"Layer {layer} was not captured", "Attention row")
    j = step.layers.index(layer)
    head = min(max(head, 0), step.probs.shape[1] - 1)
    row = step.probs[j, head]                                          # [ctx]
    blocks = [f"blk {b}" for b in step.block_table]
    if len(blocks) * step.block_size >= len(row):
        mass = step.block_mass()[j, head]                              # [num_blocks]
    else:   # a block table shorter than the context: show the gap rather than fail
        need = -(-len(row) // step.block_size)
        blocks += [f"blk ?{i}" for i in range(len(blocks), need)]
        mass = np.pad(row, (0, need * step.block_size - len(row))).reshape(need, -1).sum(-1)
    labels = [f"{i}:{_token_label(token_texts, i)}" for i in range(len(row))]
    traces = [
        go.Bar(x=labels, y=row, marker_color=DECODE_COLOUR, name="p",
               hovertemplate="%{x}<br>p=%{y:.4f}<extra></extra>"),
        go.Bar(x=blocks, y=mass, marker_color=PREFILL_COLOUR, name="block mass",
               xaxis="x2", yaxis="y2", hovertemplate="%{x}<br>mass %{y:.3f}<extra></extra>"),
    ]
    # two panels side by side, laid out by hand (make_subplots costs tens of ms per call)
    return make_figure(
        traces, f"Layer {layer}, head {head}, query token {step.position}",
        uirevision=f"row-{request_id}-{layer}-{head}", height=340, showlegend=False,
        xaxis=dict(domain=[0, 0.66], type="category", tickangle=-60, title="key token"),
        yaxis=dict(range=[0, prob_ceiling(float(row.max(initial=0)))],
                   title="attention probability"),
        xaxis2=dict(domain=[0.76, 1], type="category", tickangle=-60, title="physical block",
                    anchor="y2"),
        yaxis2=dict(range=[0, prob_ceiling(float(mass.max(initial=0)))],
                    title="mass per KV block", anchor="x2"))


def routing_figure(trace: RequestTrace, token: int, num_experts: int) -> go.Figure:
    """Router probabilities for one token, MoE layer × expert, chosen top-k experts circled."""
    r = trace.routing()
    if r is None:
        return empty_figure("No routing recorded (dense model or no tokens yet)", "MoE routing")
    probs, ids, weights = r                     # [T, M, E], [T, M, k], [T, M, k]
    token = min(max(token, 0), len(probs) - 1)
    m, e = probs.shape[1], probs.shape[2]
    y = [f"L{l}" for l in trace.moe_layers] if len(trace.moe_layers) == m else \
        [f"moe{i}" for i in range(m)]
    rows = np.repeat(np.arange(m), ids.shape[2])
    traces = [
        go.Heatmap(z=np.sqrt(np.clip(probs[token], 0, 1)), x=list(range(e)), y=y, zmin=0,
                   zmax=1, colorscale="Purples", colorbar=sqrt_prob_colorbar("router p"),
                   customdata=probs[token].round(4),
                   hovertemplate="%{y} expert %{x}<br>p=%{customdata}<extra></extra>"),
        go.Scatter(x=ids[token].reshape(-1), y=[y[i] for i in rows], mode="markers",
                   name="top-k", customdata=weights[token].reshape(-1),
                   marker=dict(symbol="circle-open", size=9, color=CHOSEN, line=dict(width=2)),
                   hovertemplate="chosen expert %{x}<br>weight %{customdata:.3f}<extra></extra>"),
    ]
    text = _token_label(trace.token_texts, token)
    return make_figure(
        traces, f"Routing of token {token} “{text}”", uirevision=f"routing-{trace.request_id}",
        height=max(240, 16 * m + 150), showlegend=False,
        xaxis=dict(title="expert", range=[-0.5, max(e, num_experts) - 0.5]),
        yaxis=dict(title="MoE layer", autorange="reversed"))


def expert_load_figure(expert_load: np.ndarray | None, moe_layers: Sequence[int] = (),
                       num_steps: int = 1) -> go.Figure:
    """Tokens routed to each expert (summed over `num_steps` recent steps), relative to an
    even split across experts."""
    if expert_load is None or np.size(expert_load) == 0:
        return empty_figure("No expert load (dense model or no step yet)", "Expert load")
    load = np.asarray(expert_load, dtype=np.float64)                   # [M, E]
    m, e = load.shape
    even = load.sum(1, keepdims=True) / e
    rel = np.divide(load, even, out=np.zeros_like(load), where=even > 0)
    y = [f"L{l}" for l in moe_layers] if len(moe_layers) == m else [f"moe{i}" for i in range(m)]
    heat = go.Heatmap(
        z=rel, x=list(range(e)), y=y, zmin=0, zmax=4, colorscale="YlOrRd",
        customdata=load.astype(int), colorbar=dict(title="÷ even"),
        hovertemplate="%{y} expert %{x}<br>%{customdata} tokens (%{z:.1f}× even)<extra></extra>")
    span = "latest step" if num_steps == 1 else f"last {num_steps} steps"
    return make_figure(
        [heat], f"Expert load, {span} (1 = even share)", uirevision="expert-load",
        height=max(240, 16 * m + 150), xaxis=dict(title="expert"),
        yaxis=dict(title="MoE layer", autorange="reversed"))
