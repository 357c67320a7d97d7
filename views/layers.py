"""Layers tab: the watched reply's residual norms, logit lens, attention heads and MoE routing,
live while it streams; a slider scrubs tokens (it follows the newest token until moved)."""
from __future__ import annotations

import gradio as gr
import numpy as np

from views import figures as F
from views.live import EngineHub

TICK_S = 0.4
LOAD_STEPS = 32      # expert load is summed over this many recent steps: one step is too noisy
NO_REQUEST = ("Send a message in the **Chat** tab: its reply is traced here, token by token "
              "(norms, logit lens, attention, routing).")


def build(hub: EngineHub) -> gr.Timer:
    """The Layers tab's components and events; returns its timer."""
    timer = gr.Timer(TICK_S, active=False)
    last = gr.State({})
    status = gr.Markdown(NO_REQUEST, elem_id="layers-status")
    with gr.Row():
        token = gr.Slider(0, 1, 0, step=1, label="token (position in prompt + reply)",
                          elem_id="layers-token", scale=4)
        follow = gr.Checkbox(True, label="follow newest token", elem_id="layers-follow",
                             scale=1)
    norms = gr.Plot(show_label=False, elem_id="layers-norms")
    lens = gr.Plot(show_label=False, elem_id="layers-lens")
    with gr.Row():
        layer = gr.Dropdown([0], value=0, label="attention layer", elem_id="layers-layer",
                            scale=1)
        head = gr.Dropdown([0], value=0, label="head (outlined in the grid)",
                           elem_id="layers-head", scale=1)
    with gr.Row():
        with gr.Column(scale=1):
            heads = gr.Plot(show_label=False, elem_id="layers-heads")
        with gr.Column(scale=1):
            row = gr.Plot(show_label=False, elem_id="layers-row")
    with gr.Row(visible=hub.snapshot().moe is not None) as moe_row:
        with gr.Column(scale=1):
            routing = gr.Plot(show_label=False, elem_id="layers-routing")
        with gr.Column(scale=1):
            load = gr.Plot(show_label=False, elem_id="layers-expert-load")
    outputs = [status, token, layer, head, norms, lens, heads, row, routing, load, moe_row, last]

    def refresh(last_keys, tok, follow_on, layer_id, head_id, request: gr.Request):
        sess = hub.session(request.session_hash if request else None)
        rid = sess.watched
        try:
            tr = hub.llm.trace(rid) if rid else None
        except KeyError:            # never watched, or evicted: show the empty state
            tr = None
        snap = hub.snapshot()
        moe = snap.moe is not None
        if tr is None:
            key = ("none", rid, moe)
            if last_keys.get("key") == key:
                return [gr.skip()] * len(outputs)
            empty = F.empty_figure("No watched reply yet")
            return [NO_REQUEST, gr.skip(), gr.skip(), gr.skip(), empty, empty, empty, empty,
                    empty, empty, gr.Row(visible=moe), {"key": key}]
        t = len(tr.resid_norms)
        tok = t - 1 if follow_on or tok is None else min(int(tok), max(t - 1, 0))
        num_layers = tr.num_layers
        layer_id = int(layer_id) if layer_id is not None and int(layer_id) < num_layers \
            else num_layers - 1
        last_step = snap.steps[-1].step_id if snap.steps else -1
        key = (rid, t, len(tr.lens), len(tr.attention), tr.finished, tok, layer_id, head_id,
               moe, last_step if moe else None)
        if last_keys.get("key") == key:
            return [gr.skip()] * len(outputs)
        step = F.attention_step_for(tr, tok)
        num_heads = step.probs.shape[1] if step is not None else 1
        head_id = int(head_id) if head_id is not None and int(head_id) < num_heads else 0
        state = "finished" if tr.finished else "streaming…"
        msg = (f"Watching `{rid}` ({state}): {len(tr.prompt_token_ids)} prompt + "
               f"{len(tr.output_token_ids)} generated tokens · token {tok}")
        if step is None:
            heads_fig = row_fig = F.empty_figure("No attention captured yet")
        else:
            heads_fig = F.attention_heads_figure(step, layer_id, tr.token_texts, head_id, rid)
            row_fig = F.attention_row_figure(step, layer_id, head_id, tr.token_texts, rid)
        if moe:
            routing_fig = F.routing_figure(tr, tok, snap.moe["num_experts"])
            loads = [st.expert_load for st in snap.steps[-LOAD_STEPS:]
                     if st.expert_load is not None]
            load_fig = F.expert_load_figure(np.sum(loads, axis=0) if loads else None,
                                            snap.moe.get("moe_layers", ()), len(loads))
        else:
            routing_fig = load_fig = gr.skip()
        slider = gr.Slider(minimum=0, maximum=max(t - 1, 1), value=tok)
        layer_dd = gr.Dropdown(choices=list(range(num_layers)), value=layer_id)
        head_dd = gr.Dropdown(choices=list(range(num_heads)), value=head_id)
        last_keys = {"key": key}
        return [msg, slider, layer_dd, head_dd, F.norms_figure(tr, tok),
                F.logit_lens_figure(tr, hub.decode, tok), heads_fig, row_fig, routing_fig,
                load_fig, gr.Row(visible=moe), last_keys]

    controls = [last, token, follow, layer, head]
    timer.tick(refresh, controls, outputs, api_visibility="private", trigger_mode="once",
               show_progress="hidden")
    # a user's move of the slider stops following the newest token
    token.input(lambda: False, None, follow, api_visibility="private", queue=False).then(
        refresh, controls, outputs, api_visibility="private", show_progress="hidden",
        trigger_mode="always_last")
    for c in (follow, layer, head):
        c.input(refresh, controls, outputs, api_visibility="private", show_progress="hidden")
    return timer
