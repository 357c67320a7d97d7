"""Layers tab: a traced request's residual norms, logit lens, attention heads and MoE routing,
live while it streams. Any traced request can be watched (the session's own chat reply by
default; API requests that opt in to tracing too); a slider scrubs tokens (it follows the
newest token until moved); clicking a head in the heads grid, or a token in the norms or lens,
selects it (the charts are canvases: views/canvas_chart.py). For a reply that speculated, its
rejected drafts can be opened one by one: the verify step's guesses (views/drafts.py)."""
from __future__ import annotations

import gradio as gr
import numpy as np

from views import figures as F
from views import drafts as D
from views.live import LIVE_SNAPSHOT_AGE_S, TICK_IDLE_S, EngineHub, LiveTab, pace
from views.canvas_chart import canvas_chart, chart_value, empty_chart
from views.scrub_slider import ScrubSlider
from views.engine_timeline import fold

LOAD_STEPS = 32      # expert load is summed over this many recent steps: one step is too noisy
AUTO = "auto"        # this page's own latest reply
SERVER = "server"    # the newest traced request on the server, whoever sent it (API too)
AUTO_LABEL = "yours: this page's latest reply"
SERVER_LABEL = "server-wide: the newest traced request (any page or API client)"
SLIDER_CHUNK = 8      # tokens the slider's range grows by at a time while a reply streams
NO_REQUEST = ("Nothing traced yet. Send a message in the **Chat** tab: its reply is traced "
              "here token by token (norms, logit lens, attention, routing), and so is any API "
              "request that asks for a trace.")
NO_OWN = ("This page has sent no message yet: send one in the **Chat** tab and its reply shows "
          "here token by token. To watch what others (other pages, API clients) are running, "
          "pick *server-wide* under *traced request*.")
HELP = ("**What this shows:** one traced reply inside the model, token by token. *Residual "
        "norms*: the size of the residual stream after each layer (layer × token). *Logit "
        "lens*: what each layer would predict if the model stopped there. *Attention*: where "
        "the chosen token looks, per head, rebuilt from the paged KV cache. Scrub with the "
        "slider, or click a token or a head.")


def resolve_request(choice: str | None, own: str | None, traced: list[str]) -> str | None:
    """The request to show: an explicit choice; server-wide: the newest traced request;
    else (the default) this page's own latest reply, or nothing while it has none (a new
    page never opens on someone else's reply)."""
    if choice == SERVER:
        return traced[0] if traced else None
    if choice and choice != AUTO:
        return choice
    return own if own and own in traced else None


def request_choices(traced: list[str], own: set[str], running: set[str],
                    server_wide: bool = True) -> list[tuple[str, str]]:
    """Dropdown (label, value) pairs, newest first (`server_wide` False: no server-wide view,
    on a shared server without --public-traces)."""
    def label(r):
        tags = (["yours"] if r in own else []) + (["streaming"] if r in running else [])
        return f"{r} ({', '.join(tags)})" if tags else r
    head = [(AUTO_LABEL, AUTO)] + ([(SERVER_LABEL, SERVER)] if server_wide else [])
    return head + [(label(r), r) for r in traced]


def slider_max(t: int, finished: bool) -> int:
    """The token slider's end for a trace of `t` tokens: the last token once the reply is
    finished (the knob at the end is the last token); while it streams, the range grows
    SLIDER_CHUNK tokens at a time (a props update costs the browser ~45 ms, a value a few),
    so the knob stays within a chunk of the end."""
    if finished or t <= 1:
        return max(t - 1, 1)
    return max(-(-t // SLIDER_CHUNK) * SLIDER_CHUNK - 1, 1)


def attention_note(tr, tok: int) -> str:
    """Why no attention row is shown for this token."""
    if tok < len(tr.prompt_token_ids) - 1:
        return (f" · no attention recorded for prompt token {tok}: the engine records the "
                "newest query of each step, plus whole prompts prefilled in one go without a "
                "prefix-cache hit (this one was not)")
    return f" · no attention recorded for token {tok} yet"


def build(hub: EngineHub) -> LiveTab:
    """The Layers tab's components and events; returns its timer and refresh."""
    timer = gr.Timer(TICK_IDLE_S, active=False)
    last = gr.State({})
    gr.Markdown(HELP, elem_classes=["gb-help"], elem_id="layers-help")
    status = gr.Markdown(NO_OWN, elem_id="layers-status")
    with gr.Row():
        req = gr.Dropdown([(AUTO_LABEL, AUTO), (SERVER_LABEL, SERVER)], value=AUTO,
                          label="traced request (yours by default; server-wide: everyone's)",
                          elem_id="layers-request", scale=2)
        token = ScrubSlider(0, 1, 0, step=1, label="token (position in prompt + reply)",
                            elem_id="layers-token", scale=4)
        follow = gr.Checkbox(True, label="follow newest token", elem_id="layers-follow",
                             scale=1)
    norms = canvas_chart("layers-norms")
    lens = canvas_chart("layers-lens")
    # speculative decoding: a rejected draft's verify step (shown for a reply that speculated)
    with gr.Column(visible=False, elem_id="layers-rejections") as rej_box:
        gr.Markdown(D.LAYERS_HELP, elem_classes=["gb-help"])
        rej = gr.Dropdown([], value=None, label="rejected drafts: open one's verify step",
                          elem_id="layers-rejection")
        rej_view = gr.HTML("", elem_id="layers-rejection-view")
    with gr.Row():
        layer = gr.Dropdown([0], value=0, label="attention layer", elem_id="layers-layer",
                            scale=1)
        head = gr.Dropdown([0], value=0, label="head (or click one in the grid)",
                           elem_id="layers-head", scale=1)
    with gr.Row():
        with gr.Column(scale=1):
            heads = canvas_chart("layers-heads")
        with gr.Column(scale=1):
            row = canvas_chart("layers-row")
    with gr.Row(visible=hub.snapshot().moe is not None) as moe_row:
        with gr.Column(scale=1):
            routing = canvas_chart("layers-routing")
        with gr.Column(scale=1):
            load = canvas_chart("layers-expert-load")
    outputs = [status, req, token, follow, layer, head, norms, lens, heads, row, routing, load,
               moe_row, rej_box, rej, rej_view, timer, last]
    skip_all = [gr.skip()] * len(outputs)

    def refresh(last_keys, choice, tok, follow_on, layer_id, head_id, request: gr.Request):
        if hub.switching:
            return skip_all
        sess = hub.session(request.session_hash if request else None)
        llm = hub.llm
        snap = hub.snapshot(max_age=LIVE_SNAPSHOT_AGE_S)    # not the previous tick's
        fold(hub, snap)              # the Engine tab's history keeps counting meanwhile
        traced = llm.traced_requests()
        if not getattr(hub, "public_traces", True):
            # a shared server (a key, or reachable beyond this machine) without
            # --public-traces: a page reads only its own replies' traces
            traced = [r for r in traced if r in sess.replies]
            if choice == SERVER:
                choice = AUTO
        moe = snap.moe is not None
        out = dict(zip(outputs, skip_all))
        keys = dict(last_keys)
        pace(timer, keys, snap, out)
        note = ""
        if choice not in (None, AUTO, SERVER) and choice not in traced:
            note = f" (`{choice}` is no longer traced: the engine keeps the newest traces only)"
            choice = AUTO
            out[req] = gr.Dropdown(value=AUTO)
        rid = resolve_request(choice, sess.watched, traced)
        choices = request_choices(traced, set(sess.replies), set(snap.running),
                                  server_wide=getattr(hub, "public_traces", True))
        if choices != keys.get("choices"):
            out[req] = gr.Dropdown(choices=choices, value=choice or AUTO)
            keys["choices"] = choices
        try:
            tr = llm.trace(rid) if rid else None
        except KeyError as e:       # evicted between the listing and now, or never watched
            tr, note = None, f" ({e.args[0] if e.args else e})"
        t = len(tr.resid_norms) if tr is not None else 0
        if tr is None or t == 0:
            key = ("none", rid, moe, note)
            if keys.get("key") == key:
                return [out[o] for o in outputs[:-1]] + [keys]
            keys["key"] = key
            msg = (f"Waiting for `{rid}`'s first step…" if tr is not None else
                   NO_OWN if choice in (None, AUTO) else NO_REQUEST) + note
            empty = chart_value(empty_chart("No traced tokens yet"))
            out.update({status: msg, norms: empty, lens: empty, heads: empty, row: empty,
                        routing: empty, load: empty, moe_row: gr.Row(visible=moe)})
            _rejections(None, rid, keys, out)
            return [out[o] for o in outputs[:-1]] + [keys]

        # the scrubbed token: the newest processed one while following
        new_tok = t - 1 if follow_on or tok is None else min(max(int(tok), 0), t - 1)
        # the slider's range grows a chunk at a time: a props update (a new gr.Slider) costs
        # the browser ~45 ms, a plain value a few; a scrub past the newest token is clamped
        top = slider_max(t, tr.finished)
        if top != keys.get("slider_max") or keys.get("slider_rid") != rid:
            keys["slider_max"], keys["slider_rid"] = top, rid
            out[token] = gr.Slider(minimum=0, maximum=top, value=new_tok)
        elif new_tok != tok:
            out[token] = new_tok
        tok = new_tok
        num_layers = tr.num_layers
        layer_id = int(layer_id) if layer_id is not None and 0 <= int(layer_id) < num_layers \
            else num_layers - 1
        step = F.attention_step_for(tr, tok)
        num_heads = step.shape[1] if step is not None else snap.num_heads or 1
        head_id = int(head_id) if head_id is not None and 0 <= int(head_id) < num_heads else 0
        if (num_layers, num_heads) != keys.get("dims"):
            out[layer] = gr.Dropdown(choices=list(range(num_layers)), value=layer_id)
            out[head] = gr.Dropdown(choices=list(range(num_heads)), value=head_id)
            keys["dims"] = (num_layers, num_heads)

        state = "finished" if tr.finished else "streaming…"
        text = tr.token_texts[tok] if tok < len(tr.token_texts) else "?"
        msg = (f"Watching `{rid}` ({state}) · token **{tok}** {text!r} of {t} processed · "
               f"{len(tr.prompt_token_ids)} prompt + {len(tr.output_token_ids)} generated"
               + ("" if step is not None else attention_note(tr, tok)) + note)
        if msg != keys.get("msg"):
            out[status] = keys["msg"] = msg
        # each figure is rebuilt (and sent) only when what it shows changed
        parts = {
            "norms": ((rid, t, tok, tr.finished), lambda: F.norms_figure(tr, tok)),
            "lens": ((rid, len(tr.lens), tok), lambda: F.logit_lens_figure(tr, hub.decode, tok)),
            "heads": ((rid, tok, layer_id, head_id, step is not None, tr.finished),
                      lambda: F.attention_heads_figure(step, layer_id, tr.token_texts, head_id,
                                                       rid, not tr.finished) if step is not None else
                      empty_chart(f"No attention recorded for token {tok}", "Attention heads")),
            "row": ((rid, tok, layer_id, head_id, step is not None),
                    lambda: F.attention_row_figure(step, layer_id, head_id, tr.token_texts, rid)
                    if step is not None else
                    empty_chart(f"No attention recorded for token {tok}", "Attention row")),
        }
        if moe:
            last_step = snap.steps[-1].step_id if snap.steps else -1

            def load_fig():
                loads = [st.expert_load for st in snap.steps[-LOAD_STEPS:]
                         if st.expert_load is not None]
                return F.expert_load_figure(np.sum(loads, axis=0) if loads else None,
                                            snap.moe.get("moe_layers", ()), len(loads))
            parts["routing"] = ((rid, tok, len(tr.router_probs) > tok),
                                lambda: F.routing_figure(tr, tok, snap.moe["num_experts"]))
            parts["load"] = ((last_step,), load_fig)
        comp = {"norms": norms, "lens": lens, "heads": heads, "row": row, "routing": routing,
                "load": load}
        for name, (key, make) in parts.items():
            if keys.get(name) != key:
                out[comp[name]] = chart_value(make())
                keys[name] = key
        if keys.get("moe") != moe:
            out[moe_row] = gr.Row(visible=moe)
            keys["moe"] = moe
        _rejections(tr, rid, keys, out)
        keys.update(t=t, key=None)
        return [out[o] for o in outputs[:-1]] + [keys]

    def _rejections(tr, rid, keys: dict, out: dict) -> None:
        """The rejected drafts of a reply that speculated: the list, and the picked one's verify
        step (the newest until one is picked), rebuilt only when they change (a verdict joins
        the trace with its rows, so the count of verdicts says when)."""
        shown = bool(tr is not None and tr.drafts)
        if keys.get("rej_shown", False) != shown:
            out[rej_box] = gr.Column(visible=shown)
            keys["rej_shown"] = shown
        if not shown:
            return
        key = (rid, len(tr.drafts), tr.finished, keys.get("rej_pick"))
        if keys.get("rej") == key:
            return
        keys["rej"] = key
        rejs = [r for r in D.rejections(tr) if r.lens is not None]
        choices = D.rejection_choices(rejs, hub.decode)
        pick = keys.get("rej_pick")         # (request id, position) picked on this page
        chosen = next((r for r in rejs if (rid, str(r.position)) == pick),
                      rejs[-1] if rejs else None)
        value = str(chosen.position) if chosen else None
        if (choices, value) != keys.get("rej_choices"):
            keys["rej_choices"] = (choices, value)
            out[rej] = gr.Dropdown(choices=choices, value=value)
        out[rej_view] = (D.rejection_html(chosen, hub.decode) if chosen is not None else
                         f"<p>{len(tr.drafts)} verifies so far: the model accepted every draft "
                         "it checked.</p>")

    controls = [last, req, token, follow, layer, head]
    # show_progress_on: Gradio tracks a loading status for every component it is given, on
    # every tick, even hidden; over all 15 outputs that bookkeeping was most of the page's
    # main-thread time (1.2-2 updates/s measured, 3.8-4.8 with one); a State, which Gradio's
    # page does not snapshot (views/live.py says why)
    timer.tick(refresh, controls, outputs, api_visibility="private", trigger_mode="once",
               show_progress="hidden", show_progress_on=[last], queue=False)
    # a user's move of the slider stops following the newest token
    token.input(lambda: False, None, follow, api_visibility="private", queue=False).then(
        refresh, controls, outputs, api_visibility="private", show_progress="hidden",
        trigger_mode="always_last")
    for c in (req, follow, layer, head):
        c.input(refresh, controls, outputs, api_visibility="private", show_progress="hidden",
                trigger_mode="always_last")

    def clicked(pick):
        """A click handler: `pick(point)` reads {"head": h} or {"token": t} from the clicked
        point of a live plot ({x, y, curve})."""
        def on_click(last_keys, choice, tok, follow_on, layer_id, head_id, evt: gr.EventData,
                     request: gr.Request):
            try:
                data = pick(evt._data or {})
            except (TypeError, ValueError):     # a click between cells: nothing to pick
                return skip_all
            if data.get("head") is not None:
                head_id = int(data["head"])
            if data.get("token") is not None:
                tok, follow_on = int(data["token"]), False
            res = refresh(last_keys, choice, tok, follow_on, layer_id, head_id, request)
            res[outputs.index(follow)] = follow_on
            res[outputs.index(head)] = gr.Dropdown(value=head_id)
            t = res[-1].get("t") if isinstance(res[-1], dict) else None
            if data.get("token") is not None and t:
                res[outputs.index(token)] = gr.Slider(maximum=max(t - 1, 1),
                                                      value=min(tok, t - 1))
            return res
        return on_click

    def on_rejection(last_keys, choice, tok, follow_on, layer_id, head_id, pick,
                     request: gr.Request):
        """A rejection picked: its view, and the slider to the query that chose in its place
        (the lens column and the attention of the verify pass's row)."""
        keys = dict(last_keys or {})
        keys["rej_pick"] = (keys.get("slider_rid"), pick)
        keys["rej"] = None
        if not pick:
            return refresh(keys, choice, tok, follow_on, layer_id, head_id, request)
        tok = int(pick) - 1
        res = refresh(keys, choice, tok, False, layer_id, head_id, request)
        res[outputs.index(follow)] = False
        t = res[-1].get("t") if isinstance(res[-1], dict) else None
        if t:
            res[outputs.index(token)] = gr.Slider(maximum=max(t - 1, 1), value=min(tok, t - 1))
        return res

    rej.input(on_rejection, controls + [rej], outputs, api_visibility="private",
              show_progress="hidden", trigger_mode="always_last")

    picks = {heads: lambda p: {"head": int(str(p["y"]).lstrip("h"))},
             norms: lambda p: {"token": int(p["x"])},
             lens: lambda p: {"token": int(p["x"])}}
    for plot, pick in picks.items():
        plot.click(clicked(pick), controls, outputs, api_visibility="private",
                   show_progress="hidden")
    return LiveTab(timer, refresh, controls, outputs)
