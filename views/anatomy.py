"""Anatomy tab: the loaded model opened up, from its own config, modules and tensors — what a
model is (vocabulary, weights, runtime code), the path of one token with real shapes (live
numbers for the watched reply's token), one KV block as its L × 2 physical regions, what each
tensor-parallel rank holds, and depth vs width beside published Qwen shapes."""
from __future__ import annotations

import dataclasses
import functools
import threading

import gradio as gr
import numpy as np

from engine.errors import EngineShutdownError
from engine.anatomy import (SOURCE, ModelAnatomy, model_anatomy, parse_ids, pieces_of_ids,
                            published_rows, read_kv_cache_bytes, shape_row, tokenize)
from views import figures_anatomy as FA
from views import figures_anatomy_html as FH
from views import figures_anatomy_path as FP
from views.figures_tp import tp_map_figure
from views.live import EngineHub
from views.live_plot import live_plot, plot_value
from views.token_text import readable

TICK_S = 0.5
TP_DEGREES = (1, 2, 4, 8)
SAMPLE_TEXT = "Glassbox opens the model up: 47+38=85."
NO_TRACE = ("Send a message in the **Chat** tab: its reply is watched, and choosing one of its "
            "tokens here fills each stage with that token's live numbers.")

_cache: dict[int, tuple[object, ModelAnatomy]] = {}
_cache_lock = threading.Lock()


def anatomy_of(llm) -> ModelAnatomy:
    """model_anatomy(llm), computed once per engine (the model does not change under it)."""
    with _cache_lock:
        hit = _cache.get(id(llm))
        if hit is None or hit[0] is not llm:
            hit = (llm, model_anatomy(llm))
            _cache.clear()
            _cache[id(llm)] = hit
        return hit[1]


def _watched(hub: EngineHub, request) -> str | None:
    """The session's watched reply, else the newest traced request of anyone."""
    sess = hub.session(getattr(request, "session_hash", None))
    if sess.watched:
        return sess.watched
    ids = hub.llm.traced_requests()
    return ids[0] if ids else None


def _trace(hub: EngineHub, rid: str | None):
    try:
        return hub.llm.trace(rid) if rid else None
    except KeyError:            # never watched, or evicted
        return None


SWITCHING = "The model is being switched: this tab redraws when the new one is up."


def _during_switch(on_switch):
    """A handler that meets a model switch (the engine it read was shut down under it)
    returns `on_switch()` — a clear state — instead of raising into the page."""
    def wrap(fn):
        @functools.wraps(fn)
        def guarded(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except EngineShutdownError:
                return on_switch()
        return guarded
    return wrap


def _block_id(value) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0


def _block_info(hub: EngineHub, a: ModelAnatomy, block_id) -> str:
    """Owner and tokens of a block (from the snapshot) and the first numbers at its address."""
    b = _block_id(block_id)
    try:
        block = hub.llm.block_info(b) if 0 <= b < a.kv.num_blocks else None
    except (ValueError, RuntimeError):      # out of range, or the engine is switching
        block = None
    first, offset = None, 0
    if 0 <= b < a.kv.num_blocks and not (block is not None and block.hidden):
        offset = a.kv.regions(b)[0].offset
        n = min(8, a.kv.shape[5]) * a.kv.elem_bytes
        first = numbers_of(read_kv_cache_bytes(hub.llm, offset, n), a.kv.dtype)
    special = frozenset(p.id for p in a.vocabulary.special)
    return FH.block_info_html(block, a.block_size, hub.decode, first, offset, special)


def _block_outputs(hub: EngineHub, a: ModelAnatomy, block_id) -> tuple:
    return (plot_value(FA.kv_regions_figure(a.kv, _block_id(block_id))),
            _block_info(hub, a, block_id))


def numbers_of(raw: bytes, dtype: str) -> np.ndarray:
    """Raw little-endian cache bytes as float64 numbers, for display."""
    if dtype == "bfloat16":     # no numpy bfloat16: its bits are the top half of a float32
        return (np.frombuffer(raw, "<u2").astype(np.uint32) << 16).view(np.float32).astype(float)
    return np.frombuffer(raw, {"float16": "<f2", "float64": "<f8"}.get(dtype, "<f4")).astype(float)


def shown_pieces(tokenizer, pieces):
    """Token pieces with byte fragments shown as <0xNN> instead of "�"."""
    return [dataclasses.replace(p, text=readable(tokenizer, p.id, p.text)) for p in pieces]


def _tp_outputs(a: ModelAnatomy, tp, weights_dtype: str, gpu_gb, utilisation) -> tuple:
    elem = 2 if weights_dtype == "bfloat16" else a.weights.elem_bytes
    try:
        gpu = int(float(gpu_gb) * 1e9)
        util = float(utilisation)
    except (TypeError, ValueError):
        gpu, util = 141 * 10**9, 0.9
    plans = [a.tp_plan(t, elem_bytes=elem, gpu_bytes=gpu, utilisation=util) for t in TP_DEGREES]
    plan = next(p for p in plans if p.tp == int(tp))
    layouts = [r.layout for r in plan.ranks]
    tp_map = (tp_map_figure(layouts, a.arch.num_heads, a.arch.num_kv_heads) if layouts
              else FA.empty_figure(f"TP {plan.tp} is not possible", "Tensor-parallel map"))
    return (plot_value(FA.tp_bytes_figure(plans, a.tp_size)), plot_value(tp_map),
            FH.tp_table_html(plan, a))


def _shape_rows(a: ModelAnatomy):
    return published_rows() + [shape_row(a.model_name, a.arch, loaded=True)]


def build(hub: EngineHub) -> gr.Timer:
    """The Anatomy tab's components and events; returns its timer (live numbers, model switch)."""
    a = anatomy_of(hub.llm)
    timer = gr.Timer(TICK_S, active=False)
    # the statics below are drawn for this engine, block 0
    last = gr.State({"llm": id(hub.llm), "block": (id(hub.llm), 0, None)})
    gr.Markdown("**What this shows:** the loaded model opened up, read from the running engine "
                "(its config, modules, tensors and code; only section 5's published shapes are "
                "typed in). Open a section to read it: each fits a screen.",
                elem_id="anatomy-intro", elem_classes=["gb-help"])

    with gr.Accordion("1 · What a model is: vocabulary + weights + runtime code", open=True,
                      elem_id="anatomy-sec-1"):
        with gr.Row():
            with gr.Column(scale=1):
                text = gr.Textbox(SAMPLE_TEXT, label="type text → tokens and ids",
                                  elem_id="anatomy-text")
                tok = hub.llm.tokenizer
                toks = gr.HTML(FH.tokens_html(shown_pieces(tok, tokenize(tok, SAMPLE_TEXT)))
                               if tok else "", elem_id="anatomy-tokens")
                ids = gr.Textbox("", label="or type ids → text", placeholder="e.g. 1 882 27",
                                 elem_id="anatomy-ids")
                decoded = gr.HTML("", elem_id="anatomy-decoded")
            with gr.Column(scale=1):
                vocab = gr.HTML(FH.vocabulary_html(a.vocabulary), elem_id="anatomy-vocab")
        weights_plot = live_plot("anatomy-weights", FA.weights_figure(a.weights))
        with gr.Accordion("Weights: every part, its shape and size", open=False):
            weights_table = gr.HTML(FH.weights_table_html(a.weights),
                                    elem_id="anatomy-weights-table")
        with gr.Accordion("Runtime code: which file and kernel runs each stage", open=False,
                          elem_id="anatomy-code-fold"):
            code = gr.HTML(FH.code_table_html(a.code, a.device), elem_id="anatomy-code")

    with gr.Accordion("2 · The path of one token: id → embedding → layers → LM head → "
                      "sampling, with the watched reply's live numbers", open=False,
                      elem_id="anatomy-sec-2"):
        status = gr.Markdown(NO_TRACE, elem_id="anatomy-live-status")
        with gr.Row():
            token = gr.Slider(0, 1, 0, step=1, label="watched reply's token (position)",
                              elem_id="anatomy-token", scale=4)
            follow = gr.Checkbox(True, label="follow newest token", elem_id="anatomy-follow",
                                 scale=1)
        path = gr.HTML(FP.token_path_html(a), elem_id="anatomy-path")
        inside = gr.HTML(FP.layer_html(a), elem_id="anatomy-layer")

    with gr.Accordion("3 · The KV cache data plane: one logical block = L × 2 physical "
                      "regions (K and V of every layer)", open=False,
                      elem_id="anatomy-sec-3"):
        plane = gr.HTML(FH.kv_plane_html(a.kv, a.tp_size), elem_id="anatomy-kv-plane")
        block = gr.Number(0, label="block id", precision=0, minimum=0, elem_id="anatomy-block")
        fig0, info0 = _block_outputs(hub, a, 0)
        regions = live_plot("anatomy-regions", fig0)
        block_info = gr.HTML(info0, elem_id="anatomy-block-info")

    with gr.Accordion("4 · Tensor parallelism: how heads, MLP slices and vocabulary split "
                      "across ranks", open=False, elem_id="anatomy-sec-4"):
        with gr.Row():
            tp = gr.Radio(list(TP_DEGREES), value=a.tp_size if a.tp_size in TP_DEGREES else 1,
                          label="TP degree (what if)", elem_id="anatomy-tp")
            wdtype = gr.Radio([a.dtype, "bfloat16"] if a.dtype != "bfloat16" else ["bfloat16"],
                              value=a.dtype, label="weights dtype", elem_id="anatomy-tp-dtype")
            gpu_gb = gr.Number(141, label="GPU memory (GB as sold: 10⁹ bytes)", minimum=1,
                               elem_id="anatomy-gpu-gb")
            util = gr.Slider(0.5, 1.0, 0.9, step=0.05, label="utilisation",
                             elem_id="anatomy-gpu-util")
        bytes0, map0, table0 = _tp_outputs(a, tp.value, a.dtype, 141, 0.9)
        with gr.Row():
            with gr.Column(scale=1):
                tp_bytes = live_plot("anatomy-tp-bytes", bytes0)
            with gr.Column(scale=1):
                tp_map = live_plot("anatomy-tp-map", map0)
        tp_table = gr.HTML(table0, elem_id="anatomy-tp-table")

    with gr.Accordion("5 · Depth vs width: the loaded model beside published Qwen shapes",
                      open=False, elem_id="anatomy-sec-5"):
        rows = _shape_rows(a)
        depth = live_plot("anatomy-depth", FA.depth_width_figure(rows))
        shapes = gr.HTML(FH.shapes_table_html(rows, SOURCE), elem_id="anatomy-shapes")

    # ---- events ------------------------------------------------------------------------------
    def on_text(t: str):
        try:
            tok = hub.llm.tokenizer
            return FH.tokens_html(shown_pieces(tok, tokenize(tok, t or "")))
        except ValueError as e:
            return f"<div style='color:#d62728'>{FH.esc(e)}</div>"

    def on_ids(t: str):
        llm = hub.llm
        try:
            pieces = shown_pieces(llm.tokenizer, pieces_of_ids(
                llm.tokenizer, parse_ids(t or "", llm.hf_config.vocab_size)))
        except ValueError as e:
            return f"<div style='color:#d62728'>{FH.esc(e)}</div>"
        if not pieces:
            return FH.tokens_html(pieces)
        text_of = FH.esc(hub.decode([p.id for p in pieces]))
        return FH.tokens_html(pieces) + f"<div>text: <b>{text_of}</b></div>"

    text.change(on_text, text, toks, api_visibility="private", trigger_mode="always_last")
    ids.change(on_ids, ids, decoded, api_visibility="private", trigger_mode="always_last")

    @_during_switch(lambda: (gr.skip(), SWITCHING))
    def on_block(b):
        return _block_outputs(hub, anatomy_of(hub.llm), b)

    block.change(on_block, block, [regions, block_info], api_visibility="private")

    @_during_switch(lambda: (gr.skip(), gr.skip(), SWITCHING))
    def on_tp(t, d, g, u):
        return _tp_outputs(anatomy_of(hub.llm), t, d, g, u)

    for c in (tp, wdtype, gpu_gb, util):
        c.change(on_tp, [tp, wdtype, gpu_gb, util], [tp_bytes, tp_map, tp_table],
                 api_visibility="private")

    statics = [vocab, weights_plot, weights_table, code, plane, depth, shapes, tp, wdtype, gpu_gb,
               util, tp_bytes, tp_map, tp_table]

    @_during_switch(lambda: {status: SWITCHING})
    def refresh(last_keys: dict, tok, follow_on, block_id, request: gr.Request):
        if hub.switching:           # the old engine is shut down, the next one not yet up
            return {status: SWITCHING}
        llm = hub.llm
        a = anatomy_of(llm)
        out = {}
        if last_keys.get("llm") != id(llm):          # a model switch: redraw everything
            rows = _shape_rows(a)
            running = a.tp_size if a.tp_size in TP_DEGREES else 1
            out[tp_bytes], out[tp_map], out[tp_table] = _tp_outputs(a, running, a.dtype, 141,
                                                                    0.9)
            out.update({vocab: FH.vocabulary_html(a.vocabulary),
                        weights_plot: plot_value(FA.weights_figure(a.weights)),
                        weights_table: FH.weights_table_html(a.weights),
                        code: FH.code_table_html(a.code, a.device),
                        plane: FH.kv_plane_html(a.kv, a.tp_size),
                        depth: plot_value(FA.depth_width_figure(rows)),
                        shapes: FH.shapes_table_html(rows, SOURCE),
                        tp: gr.Radio(value=running), gpu_gb: 141, util: 0.9,
                        wdtype: gr.Radio(choices=[a.dtype, "bfloat16"] if a.dtype != "bfloat16"
                                         else ["bfloat16"], value=a.dtype)})
        rid = _watched(hub, request)
        tr = _trace(hub, rid)
        n = len(tr.resid_norms) if tr is not None else 0
        t = max(n - 1, 0) if follow_on or tok is None else min(int(tok), max(n - 1, 0))
        snap = hub.snapshot()
        last_step = snap.steps[-1].step_id if snap.steps else -1
        live_key = (id(llm), rid, n, len(tr.lens) if tr else 0, t)
        if live_key != last_keys.get("live"):
            live = FA.live_token(tr, t, hub.decode) if tr is not None else None
            out[status] = (NO_TRACE if tr is None else
                           f"Watching `{rid}` ({'finished' if tr.finished else 'streaming…'}): "
                           f"token {t} of {n} · " + ("its live numbers are in green below"
                                                     if live is not None else "it came from the "
                                                     "prefix cache: not computed in this request"))
            out[token] = gr.Slider(minimum=0, maximum=max(n - 1, 1), value=t)
            out[path] = FP.token_path_html(a, live)
            out[inside] = FP.layer_html(a, live)
        block_key = (id(llm), block_id, last_step)
        if block_key != last_keys.get("block"):
            out[block_info] = _block_info(hub, a, block_id)
            if block_key[:2] != tuple(last_keys.get("block", ())[:2]):
                out[regions] = plot_value(FA.kv_regions_figure(a.kv, _block_id(block_id)))
        out[last] = {"llm": id(llm), "live": live_key, "block": block_key}
        return out

    outputs = set(statics) | {status, token, path, inside, regions, block_info, last}
    controls = [last, token, follow, block]
    timer.tick(refresh, controls, outputs, api_visibility="private", trigger_mode="once",
               show_progress="hidden", show_progress_on=[status])   # see views/layers.py
    token.input(lambda: False, None, follow, api_visibility="private", queue=False).then(
        refresh, controls, outputs, api_visibility="private", show_progress="hidden",
        trigger_mode="always_last")
    follow.input(refresh, controls, outputs, api_visibility="private", show_progress="hidden")
    return timer
