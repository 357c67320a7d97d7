"""Pure builders for the Layers tab: residual norms, logit lens, attention heads, MoE routing.

Each returns a canvas chart spec (views/canvas_chart.py draws it): these charts change with
every token, and a canvas redraw costs the browser a few milliseconds where a plotly figure
costs tens. Token positions index the prompt + reply; the scrubbed token is outlined in every
chart that shows it.
"""
from __future__ import annotations

import json
from collections import OrderedDict
from typing import Callable, Sequence

import numpy as np

from engine.probes.trace import AttentionStep, RequestTrace
from views.canvas_chart import (BLUES, MAGMA_R, PURPLES, VIRIDIS, YLORRD, empty_chart,
                                pack_matrix)
from views.figures_common import DECODE_COLOUR, PREFILL_COLOUR, PROB_TICKS, short_text
from views.trace_texts import key_hovers, number_labels, short_texts

Decode = Callable[[Sequence[int]], str]
Chart = dict
MAX_LENS_STEPS = 24        # lens columns shown around the chosen token
MAX_LABELLED_TOKENS = 48   # past this, token axes show positions instead of token text
CHOSEN = "#e15759"         # outline of the scrubbed token
CHOSEN_HEAD = "#2ca02c"    # outline of the chosen head
CACHED = "rgba(173,181,189,0.75)"


def prob_ceiling(peak: float) -> float:
    """A y-axis top from a few fixed steps, so the axis only moves when the peak crosses one."""
    for top in (0.05, 0.1, 0.25, 0.5, 1.0):
        if peak <= top:
            return top
    return 1.0


def _stepped(n: int, streaming: bool = True) -> int:
    """An axis end that moves in steps (32 tokens, 64 past 128), not with every new token,
    while a reply streams; once it is finished, the axis ends on its last token."""
    if not streaming:
        return n
    step = 32 if n <= 128 else 64
    return 16 if n <= 16 else -(-n // step) * step


def _text(texts: Sequence[str], i: int, limit: int = 12) -> str:
    return short_text(texts[i], limit) if i < len(texts) else "?"


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) spans where `mask` is True."""
    edges = np.diff(np.concatenate([[0], mask.astype(np.int8), [0]]))
    return list(zip(np.flatnonzero(edges == 1).tolist(), np.flatnonzero(edges == -1).tolist()))


def _ticks(lo: float, hi: float, fmt: str = "{:.3g}") -> list[list]:
    return [[v, fmt.format(v)] for v in (lo, (lo + hi) / 2, hi)]


def _token_texts(trace: RequestTrace, n: int) -> list[str]:
    """Short texts of the first n tokens (made once per token: views/trace_texts.py)."""
    texts = short_texts(trace.request_id, trace.token_texts)[:n]
    return texts + ["?"] * (n - len(texts))


_NORMS: OrderedDict[str, tuple[int, object, np.ndarray]] = OrderedDict()


def stacked_norms(trace: RequestTrace) -> np.ndarray:
    """trace.norms(), grown by the new rows since the last call for this request (a live tab
    stacks the whole trace several times a second otherwise). Trusted while the last row it
    stacked is the same array object (rows are replaced, never written in place)."""
    rows = trace.resid_norms
    n = len(rows)
    hit = _NORMS.get(trace.request_id)
    if hit is not None and 0 < hit[0] <= n and rows[hit[0] - 1] is hit[1]:
        m, _, done = hit
        out = done if m == n else np.concatenate([done, np.stack(rows[m:n])])
    else:
        out = trace.norms()
    if n:
        _NORMS[trace.request_id] = (n, rows[n - 1], out)
        _NORMS.move_to_end(trace.request_id)
        while len(_NORMS) > 64:
            _NORMS.popitem(last=False)
    return out


_RANGES: OrderedDict[tuple, tuple[object, float, float]] = OrderedDict()


def _norm_range(request_id: str, norms: np.ndarray, n_prompt: int, cached: np.ndarray,
                prompt_done: bool, anchor: object = None) -> tuple[float, float]:
    """The colour range, from the prompt's rows once they are all there (then it is fixed:
    kept per request, not re-sorted every tick), clipped at the 99th percentile so an
    attention-sink token's huge norm does not wash out the rest. `anchor`: the prompt's last
    norm row object; a kept range is trusted only for that same object (a request id can come
    again — a client's X-Request-Id, a new engine — with other norms)."""
    whole = prompt_done and n_prompt and not cached[:n_prompt].all()
    key = (request_id, n_prompt)
    hit = _RANGES.get(key) if whole else None
    if hit is not None and anchor is not None and hit[0] is anchor:
        return hit[1], hit[2]
    ref = norms[:n_prompt] if n_prompt and not cached[:n_prompt].all() else norms
    if np.isnan(ref).all():
        zmin, zmax = 0.0, 1.0
    else:
        zmin, zmax = float(np.nanmin(ref)), float(np.nanpercentile(ref, 99))
    if not zmax > zmin:
        zmax = zmin + 1.0
    if whole and request_id and anchor is not None:
        _RANGES[key] = (anchor, zmin, zmax)
        while len(_RANGES) > 256:
            _RANGES.popitem(last=False)
    return zmin, zmax


def norms_figure(trace: RequestTrace, token: int | None = None) -> Chart:
    """Residual-stream L2 norm, layer × token; prompt/reply boundary and scrubbed token marked,
    prefix-cached tokens (never computed for this request) greyed."""
    norms = stacked_norms(trace)                              # [T, num_layers + 1]
    title = ("Residual norms (layer × token) · dashed line: where the reply starts · click a "
             "token to scrub to it")
    if len(norms) == 0:
        return empty_chart("No tokens processed yet", title)
    t = len(norms)
    n_prompt = min(len(trace.prompt_token_ids), t)
    cached = np.isnan(norms).all(axis=1)
    # colour range from the prompt (fixed once prefill ran), clipped so an attention-sink
    # token's huge norm does not wash out the rest
    zmin, zmax = _norm_range(trace.request_id, norms, n_prompt, cached,
                             len(trace.prompt_token_ids) <= t,
                             trace.resid_norms[n_prompt - 1] if n_prompt else None)
    y = ["embed"] + [f"L{i}" for i in range(norms.shape[1] - 1)]
    texts = _token_texts(trace, t)
    spans = [{"from": a, "to": b, "fill": CACHED, "label": "prefix cache: not recomputed"}
             for a, b in _runs(cached)]
    return {
        "kind": "heatmap", "title": title, "height": max(240, 16 * len(y) + 130),
        "z": norms.T, "zmin": zmin, "zmax": zmax, "colorscale": VIRIDIS,
        "y_labels": y, "x_start": 0, "x_end": _stepped(t, not trace.finished),
        "x_labels": [f"{i}:{s}" for i, s in enumerate(texts)] if t <= MAX_LABELLED_TOKENS
        else None,
        "col_text": texts, "x_name": "token", "value_name": "‖resid‖", "x_title": "token position",
        "spans": spans,
        "vlines": [{"at": n_prompt, "colour": "#ffffff", "label": "reply →"}]
        if 0 < n_prompt < t else [],
        "col_outlines": [{"from": token, "to": token + 1, "colour": CHOSEN}]
        if token is not None and 0 <= token < t else [],
        "colorbar": {"title": "‖resid‖", "ticks": _ticks(zmin, zmax)},
        "click_hint": "click to scrub to this token"}


def _lens_window(trace: RequestTrace, token: int | None) -> list[int]:
    """Indices into trace.lens to show: the newest steps, or those around the chosen token."""
    n = len(trace.lens)
    centre = n - 1
    if token is not None:
        idx = [i for i, s in enumerate(trace.lens) if s.position == token]
        centre = idx[0] if idx else centre
    lo = max(0, min(centre - MAX_LENS_STEPS // 2, n - MAX_LENS_STEPS))
    return list(range(lo, min(n, lo + MAX_LENS_STEPS)))


_TEXTS: dict[tuple[int, int], tuple[str, str]] = {}   # (decoder, id) -> (text, short), bounded


def _token_texts_of(ids, decode: Decode) -> dict[int, tuple[str, str]]:
    """{id: (text, short text)} for the distinct ids, each decoded and shortened once per
    decoder (a dict lookup afterwards: the lens shows ~7k guesses a tick, and at batch-1 speed
    every column is new)."""
    owner = id(getattr(decode, "__self__", decode))
    if len(_TEXTS) > 200_000:
        _TEXTS.clear()
    out = {}
    for t in np.unique(np.asarray(ids, dtype=np.int64)).tolist():
        key = (owner, t)
        txt = _TEXTS.get(key)
        if txt is None:
            text = decode([t])
            txt = _TEXTS[key] = (text, short_text(text, 8))
        out[t] = txt
    return out


def logit_lens_figure(trace: RequestTrace, decode: Decode, token: int | None = None) -> Chart:
    """Layer × input token: each layer's top guess for the *next* token (text) and its
    probability (shade). Columns are labelled by the token whose residual is read
    (TransformerLens' convention), so the scrubbed token's column is the one outlined.

    A cell's hover (the top-k guesses, the sampled token's rank and probability, the entropy)
    is written by the page from numbers (`lens_hover`): made here, ~7k formatted strings a
    tick would be most of the tab's Python, which shares the GIL with the engine's thread."""
    title = "Logit lens: each layer's top guess for the next token (shade = its probability)"
    if not trace.lens:
        return empty_chart("No generated tokens yet", title)
    steps = [trace.lens[i] for i in _lens_window(trace, token)]
    num_layers, k = steps[0].top_ids.shape
    top_ids = np.stack([st.top_ids for st in steps], axis=1)           # [layers, steps, k]
    top_p = np.stack([st.top_probs for st in steps], axis=1)           # [layers, steps, k]
    z = top_p[:, :, 0]                                                 # [layers, steps]
    sampled = [st.sampled_token for st in steps]
    known = _token_texts_of(np.concatenate([top_ids.reshape(-1), sampled]), decode)
    short = {i: t[1] for i, t in known.items()}
    cell_text = [list(map(short.__getitem__, row)) for row in top_ids[:, :, 0].tolist()]
    texts = {str(i): t[0] for i, t in known.items()}
    chosen = [j for j, st in enumerate(steps) if token is not None and st.position == token]
    S = len(steps)
    return {
        "kind": "heatmap", "title": title, "height": max(260, 24 * num_layers + 150),
        "z": z, "zmin": 0.0, "zmax": 1.0, "colorscale": BLUES, "dark_above": 0.5,
        "y_labels": [f"L{l}" for l in range(num_layers)],
        "x_labels": [f"{st.position}:{_text(trace.token_texts, st.position)}" for st in steps],
        "x_values": [st.position for st in steps], "x_name": "token", "value_name": "top-1 p",
        "x_title": "input token (position:text) · click one to scrub to it",
        "cell_text": cell_text,
        "lens_hover": {
            "k": int(k), "texts": texts, "sampled": [str(t) for t in sampled],
            "ids": pack_matrix(top_ids.reshape(num_layers, S * k)),     # exact: ids < 2^24
            "p": pack_matrix(top_p.reshape(num_layers, S * k)),
            "rank": pack_matrix(np.stack([st.sampled_rank for st in steps], axis=1)),
            "sp": pack_matrix(np.stack([st.sampled_prob for st in steps], axis=1)),
            "entropy": pack_matrix(np.stack([st.entropy for st in steps], axis=1))},
        "col_outlines": [{"from": j, "to": j + 1, "colour": CHOSEN} for j in chosen]}


def lens_hover_text(spec: dict, row: int, col: int) -> str:
    """The hover of one lens cell, as the page writes it (views/canvas_chart.js lensHover):
    for tests and exports."""
    from views.canvas_chart import unpack_matrix
    h = spec["lens_hover"]
    k, t = h["k"], h["texts"]
    ids, p = unpack_matrix(h["ids"]), unpack_matrix(h["p"])
    q = lambda s: json.dumps(s, ensure_ascii=False)     # noqa: E731 — JSON.stringify's quoting
    guesses = ", ".join(f"{q(t[str(int(ids[row, col * k + j]))])} {p[row, col * k + j]:.2f}"
                        for j in range(k))
    rank, sp, ent = (unpack_matrix(h[x])[row, col] for x in ("rank", "sp", "entropy"))
    return (f"next-token guesses: {guesses}\nsampled {q(t[h['sampled'][col]])}: rank "
            f"{int(rank)}, p={sp:.2f} · entropy {ent:.2f} nats")


def attention_at(trace: RequestTrace, token: int) -> AttentionStep | None:
    """The attention row of the query at `token`: a generated token's captured row, or a prompt
    token's row of the prefill pattern (captured for prompts prefilled in one go); None when
    the engine recorded neither."""
    for st in reversed(trace.attention):
        if st.position == token:
            return st
        if st.position < token:
            break
    layers = sorted(trace.prefill_pattern)
    if layers:
        pats = [trace.prefill_pattern[l] for l in layers]              # each [H, q, k]
        computed = trace.prefill_computed
        cached = computed is not None and token < len(computed) and not computed[token]
        if 0 <= token < pats[0].shape[1] and not cached:     # a prefix hit: never computed
            probs = np.stack([p[:, token, :token + 1] for p in pats])   # [layers, H, token+1]
            table, bs = ((trace.attention[0].block_table, trace.attention[0].block_size)
                         if trace.attention else ([], 1))
            return AttentionStep(token, layers, probs, list(table[:token // bs + 1]), bs)
    return None


def attention_step_for(trace: RequestTrace, token: int | None) -> AttentionStep | None:
    """The attention row for `token` (the newest captured one for None); None when the row of
    that token was not captured."""
    if token is None:
        return trace.attention[-1] if trace.attention else None
    return attention_at(trace, token)


def _context_texts(request_id: str, token_texts: Sequence[str], ctx: int) -> list[str]:
    """Short texts of the first ctx tokens; made once per request when one is named."""
    if not request_id:
        return [_text(token_texts, i) for i in range(ctx)]
    texts = short_texts(request_id, token_texts)[:ctx]
    return texts + ["?"] * (ctx - len(texts))


def _key_hovers(request_id: str, token_texts: Sequence[str], ctx: int) -> list[str]:
    if not request_id:
        return [f"key {i} “{_text(token_texts, i)}”" for i in range(ctx)]
    hov = key_hovers(request_id, token_texts)[:ctx]
    return hov + [f"key {i} “?”" for i in range(len(hov), ctx)]


def attention_heads_figure(step: AttentionStep, layer: int, token_texts: Sequence[str],
                           head: int | None = None, request_id: str = "",
                           streaming: bool = True) -> Chart:
    """One row per head: the query token's attention over its context, colour = sqrt(p) so
    small weights show; clicking a row picks that head. `streaming`: the reply is still
    growing (the key axis ends on a step, so it stays put meanwhile)."""
    qtext = _text(token_texts, step.position)
    title = f"Layer {layer}: attention of token {step.position} “{qtext}” · click a head"
    if layer not in step.layers:
        return empty_chart(f"Layer {layer} was not captured", title)
    probs = np.clip(step.layer_probs(step.layers.index(layer)), 0, 1)  # [H, ctx]
    h, ctx = probs.shape
    texts = _context_texts(request_id, token_texts, ctx)
    return {
        "kind": "heatmap", "title": title, "height": max(220, 22 * h + 130),
        "z": np.sqrt(probs), "zmin": 0.0, "zmax": 1.0, "colorscale": MAGMA_R,
        "value_fmt": "p", "y_labels": [f"h{i}" for i in range(h)], "x_start": 0,
        "x_end": _stepped(ctx, streaming),
        "x_labels": [f"{i}:{s}" for i, s in enumerate(texts)] if ctx <= MAX_LABELLED_TOKENS
        else None,
        "col_text": texts, "x_name": "key", "value_name": "p", "x_title": "key position",
        "row_outlines": [{"from": head, "to": head + 1, "colour": CHOSEN_HEAD}]
        if head is not None and 0 <= head < h else [],
        "colorbar": {"title": "p", "ticks": [[float(np.sqrt(p)), f"{p:g}"] for p in PROB_TICKS]},
        "click_hint": "click to pick this head"}


def attention_row_figure(step: AttentionStep, layer: int, head: int,
                         token_texts: Sequence[str], request_id: str = "") -> Chart:
    """The chosen head's row over the keys, and its mass per physical KV block."""
    head = min(max(head, 0), step.shape[1] - 1)            # the title names the head shown
    title = f"Layer {layer}, head {head}, query token {step.position}: attention per key and " \
            f"per KV block"
    if layer not in step.layers:
        return empty_chart(f"Layer {layer} was not captured", title)
    j = step.layers.index(layer)
    row = step.layer_probs(j)[head]                                    # [ctx]
    blocks = [str(b) for b in step.block_table]
    if len(blocks) * step.block_size >= len(row):
        mass = step.block_mass(j, head)                                # [num_blocks]
    else:   # a block table shorter than the context: show the gap rather than fail
        need = -(-len(row) // step.block_size)
        blocks += [f"?{i}" for i in range(len(blocks), need)]
        mass = np.pad(row, (0, need * step.block_size - len(row))).reshape(need, -1).sum(-1)
    ctx = len(row)
    texts = _context_texts(request_id, token_texts, ctx)
    return {
        "kind": "bars", "title": title, "height": 320,
        "panels": [
            {"width": 0.68, "values": row, "colour": DECODE_COLOUR,
             "ymax": prob_ceiling(float(row.max(initial=0))),
             "labels": [f"{i}:{s}" for i, s in enumerate(texts)]
             if ctx <= MAX_LABELLED_TOKENS else None,
             "tick_labels": number_labels(ctx),
             "hover": _key_hovers(request_id, token_texts, ctx), "value_name": "p",
             "x_title": "key token", "y_title": "attention p"},
            {"width": 0.32, "values": mass, "colour": PREFILL_COLOUR,
             "ymax": prob_ceiling(float(mass.max(initial=0))),
             "labels": [f"blk {b}" for b in blocks] if len(blocks) <= MAX_LABELLED_TOKENS
             else None,
             "tick_labels": blocks, "hover": [f"physical block {b}" for b in blocks],
             "value_name": "mass", "x_title": "physical KV block",
             "y_title": "mass per block"}]}


def routing_figure(trace: RequestTrace, token: int, num_experts: int) -> Chart:
    """Router probabilities for one token, MoE layer × expert, chosen top-k experts circled."""
    r = trace.routing()
    if r is None:
        return empty_chart("No routing recorded (dense model or no tokens yet)", "MoE routing")
    probs, ids, _ = r                           # [T, M, E], [T, M, k], [T, M, k]
    token = min(max(token, 0), len(probs) - 1)
    m, e = probs.shape[1], probs.shape[2]
    if not np.isfinite(probs[token]).any():     # served by the prefix cache: never routed here
        return empty_chart(f"Token {token} came from the prefix cache: it was not routed in "
                           "this request", "MoE routing")
    y = [f"L{l}" for l in trace.moe_layers] if len(trace.moe_layers) == m else \
        [f"moe{i}" for i in range(m)]
    return {
        "kind": "heatmap", "title": f"Routing of token {token} “{_text(trace.token_texts, token)}”"
                                    " (circles: the experts chosen)",
        "height": max(220, 20 * m + 130), "z": np.sqrt(np.clip(probs[token], 0, 1)),
        "zmin": 0.0, "zmax": 1.0, "colorscale": PURPLES, "value_fmt": "p",
        "y_labels": y, "x_start": 0, "x_end": max(e, num_experts), "x_name": "expert",
        "value_name": "router p", "x_title": "expert",
        "markers": [[i, int(x)] for i in range(m) for x in ids[token, i] if x >= 0],
        "colorbar": {"title": "router p",
                     "ticks": [[float(np.sqrt(p)), f"{p:g}"] for p in PROB_TICKS]}}


def expert_load_figure(expert_load: np.ndarray | None, moe_layers: Sequence[int] = (),
                       num_steps: int = 1) -> Chart:
    """Tokens routed to each expert (summed over `num_steps` recent steps), relative to an
    even split across experts."""
    if expert_load is None or np.size(expert_load) == 0:
        return empty_chart("No expert load (dense model or no step yet)", "Expert load")
    load = np.asarray(expert_load, dtype=np.float64)                   # [M, E]
    m, e = load.shape
    even = load.sum(1, keepdims=True) / e
    rel = np.divide(load, even, out=np.zeros_like(load), where=even > 0)
    y = [f"L{l}" for l in moe_layers] if len(moe_layers) == m else [f"moe{i}" for i in range(m)]
    span = "latest step" if num_steps == 1 else f"last {num_steps} steps"
    return {
        "kind": "heatmap", "title": f"Expert load, {span} (1 = even share)",
        "height": max(220, 20 * m + 130), "z": rel, "zmin": 0.0, "zmax": 4.0,
        "colorscale": YLORRD, "y_labels": y, "x_start": 0, "x_end": e, "x_name": "expert",
        "value_name": "× even share", "x_title": "expert",
        "cell_hover": [[f"{int(v)} tokens" for v in row] for row in load],
        "colorbar": {"title": "÷ even", "ticks": [[0, "0"], [1, "1"], [2, "2"], [4, "4"]]}}
