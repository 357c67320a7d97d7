"""Chat tab, "What if" accordion: re-run the latest message with an intervention (ablate heads,
mask experts, steer the residual) beside the untouched reply, both in one engine batch, and show
where they part: the first differing token, how the chosen tokens' logprobs moved, and both
runs' residual norms and logit lens at that token, overlaid.

The handlers are thin; `make_interventions` and `compare` are pure (unit-tested without a
browser). The Layers tab's "Re-run without this head" button (`wire_from_layers`) fills the form with
its chosen layer and head and runs the comparison; a click on a cell of its MoE routing chart
arms a second button that does the same with that layer's expert masked.
"""
from __future__ import annotations

import html
from typing import Callable, NamedTuple

import gradio as gr

from engine import Intervention, ProbeSpec, SamplingParams
from views import try_this
from views.figures_interventions import overlay_figure
from views.live_plot import live_plot, plot_value

KINDS = {"ablate heads": "ablate_heads", "mask experts": "mask_experts", "steer": "steer"}


def parse_ids(text: str, what: str) -> list[int]:
    """'0, 3' -> [0, 3]; a ValueError that says what to type."""
    try:
        ids = [int(t) for t in str(text or "").replace(",", " ").split()]
    except ValueError:
        raise ValueError(f"{what}: type integers separated by commas, e.g. 0, 3") from None
    if not ids:
        raise ValueError(f"{what}: type at least one id, e.g. 0, 3")
    return ids


def make_interventions(llm, kind: str, layer, ids: str, prompt_a: str, prompt_b: str,
                       scale, positions: str) -> list[Intervention]:
    """The form's values -> one intervention (the steering vector built from the two prompts)."""
    k = KINDS.get(kind)
    if k is None:
        raise ValueError(f"pick what to do: one of {', '.join(KINDS)}")
    layer = int(layer)
    if k == "ablate_heads":
        return [Intervention.ablate_heads(layer, parse_ids(ids, "heads"))]
    if k == "mask_experts":
        return [Intervention.mask_experts(layer, parse_ids(ids, "experts"))]
    if not (prompt_a or "").strip() or not (prompt_b or "").strip():
        raise ValueError("steer: type two contrasting prompts (A is steered towards, B away)")
    v = llm.steering_vector(layer, [{"role": "user", "content": prompt_a.strip()}],
                            [{"role": "user", "content": prompt_b.strip()}])
    return [Intervention.steer(layer, v, float(scale), positions)]


def _cell(text: str) -> str:
    """Text safe in a Markdown table cell: no HTML, no column break."""
    return html.escape(text, quote=False).replace("|", "\\|").replace("\n", " ")


def _tok(decode, t: int) -> str:
    return _cell(repr(decode([t])))


def compare(orig, edited, decode, what: str) -> str:
    """Markdown: both replies, the first token where they part, and the chosen tokens' logprob
    change (the edited run's logprob of the original's token where its top-k holds it)."""
    a, b = orig.token_ids, edited.token_ids
    part = parting(orig, edited)
    lines = [f"**Intervention:** {html.escape(what)}", "",
             "| untouched | intervened |", "| --- | --- |",
             f"| {_cell(orig.text) or '∅'} | {_cell(edited.text) or '∅'} |", ""]
    if part is None:
        # an edit that changes nothing says where edits that do are to be found
        lines.append("Same tokens from start to end. This edit changes nothing in this reply: "
                     "try another layer or head, or (on a demo) one from the *Try this* list.")
    else:
        lines.append(f"**They part at token {part}**: untouched "
                     + (_tok(decode, a[part]) if part < len(a) else "(ended)")
                     + " vs intervened " + (_tok(decode, b[part]) if part < len(b) else "(ended)"))
    rows = []
    # up to the parting token: past it, the two runs condition on different tokens
    last = len(a) if part is None else part + 1
    for i in range(min(len(orig.logprobs), len(edited.logprobs), last)):
        lo, le = orig.logprobs[i], edited.logprobs[i]
        same = le.top.get(lo.token_id)
        delta = f"{same - lo.logprob:+.3f}" if same is not None else "not in the top-k"
        rows.append(f"| {i} | {_tok(decode, lo.token_id)} | {lo.logprob:.3f} | "
                    f"{_tok(decode, le.token_id)} | {le.logprob:.3f} | {delta} |")
    if rows:
        lines += ["", "| # | untouched token | logprob | intervened token | logprob | "
                      "Δ logprob of the untouched token |", "| --- | --- | --- | --- | --- | --- |"]
        lines += rows
    return "\n".join(lines)


class WhatIf(NamedTuple):
    """The accordion's parts another tab fills and runs (see wire_from_layers)."""
    accordion: gr.Accordion
    kind: gr.Radio
    layer: gr.Number
    ids: gr.Textbox
    compare: Callable
    inputs: list
    outputs: list
    help: gr.Markdown


def parting(orig, edited) -> int | None:
    """Index of the first reply token where the two runs differ (None: identical)."""
    a, b = orig.token_ids, edited.token_ids
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y),
                None if len(a) == len(b) else min(len(a), len(b)))


def kinds_for(moe: bool) -> list[str]:
    """The form's choices: masking experts only where the model has experts."""
    return [k for k in KINDS if moe or KINDS[k] != "mask_experts"]


def form_help(llm) -> str:
    """What the form can touch on this model: its layers and heads, and on MoE its experts."""
    cfg = llm.hf_config
    moe = list(getattr(llm.runner, "moe_layers", []))
    experts = ""
    if moe:
        top_k = getattr(cfg, "num_experts_per_tok", None)
        experts = (f", {cfg.num_experts} experts (0–{cfg.num_experts - 1}) at layers {moe}"
                   + (f", top-{top_k} routed per token" if top_k else ""))
    return ("Ablate attention heads, " + ("mask MoE experts, " if moe else "")
            + "or steer the residual stream after a layer, then compare with the untouched "
              f"reply (both run in one batch). This model: {cfg.num_hidden_layers} layers, "
              f"{cfg.num_attention_heads} heads{experts}.")


def build(hub, conversation, box, system, max_tokens) -> WhatIf:
    """The accordion, inside the chat column. Uses the latest user message of the chat (or the
    text in the message box), the system prompt and max tokens; greedy, so a difference is the
    intervention's."""
    llm = hub.llm
    cfg = llm.hf_config
    moe = bool(getattr(llm.runner, "moe_layers", []))
    with gr.Accordion("What if: re-run with an intervention", open=False,
                      elem_id="iv-accordion") as accordion:
        with gr.Row():
            with gr.Column(scale=3):
                help_md = gr.Markdown(form_help(llm), elem_id="iv-help")
                with gr.Row():
                    kind = gr.Radio(kinds_for(moe), value="ablate heads", label="what",
                                    elem_id="iv-kind")
                    layer = gr.Number(value=cfg.num_hidden_layers - 1, precision=0,
                                      label="layer", elem_id="iv-layer")
                    ids = gr.Textbox("0", label="heads / experts (e.g. 0, 3)",
                                     elem_id="iv-ids")
                # the steering fields mean nothing to an ablation: shown only for "steer"
                with gr.Row(visible=False, elem_id="iv-steer-row") as steer_row:
                    prompt_a = gr.Textbox("", label="steer: towards prompt A",
                                          elem_id="iv-prompt-a")
                    prompt_b = gr.Textbox("", label="steer: away from prompt B",
                                          elem_id="iv-prompt-b")
                    scale = gr.Number(value=2.0, label="scale", elem_id="iv-scale")
                    positions = gr.Radio(["all", "prompt", "generated"], value="all",
                                         label="positions", elem_id="iv-positions")
                run = gr.Button("Compare", variant="secondary", elem_id="iv-compare")
            tries = try_this.build(hub)         # effects found on this demo, one click each
        out = gr.Markdown("", elem_id="iv-result")
        plot = live_plot("iv-plot")
    kind.change(lambda k: gr.Row(visible=k == "steer"), kind, steer_row,
                api_visibility="private", queue=False, show_progress="hidden")

    def on_compare(conv, typed, system_prompt, n, kind_v, layer_v, ids_v, a, b, s, pos):
        try:
            user = (typed or "").strip() or next(
                (m["content"] for m in reversed(conv or []) if m.get("role") == "user"), "")
            if not isinstance(user, str) or not user.strip():
                raise ValueError("Send a message first (or type one in the box): the "
                                 "comparison re-runs it")
            msgs = ([{"role": "system", "content": system_prompt.strip()}]
                    if system_prompt and system_prompt.strip() else [])
            msgs.append({"role": "user", "content": user.strip()})
            ivs = make_interventions(hub.llm, kind_v, layer_v, ids_v, a, b, s, pos)
            sp = SamplingParams(temperature=0, max_tokens=int(n), logprobs=5)
            llm = hub.llm
            watch = ProbeSpec(attention=False, routing=False)
            orig, edited = llm.generate([msgs, msgs], sp, watch=watch,
                                        interventions=[None, ivs])
            decode = llm.tokenizer.decode
            md = compare(orig, edited, decode, ivs[0].describe())
            step = parting(orig, edited)
            step = max(0, len(orig.token_ids) - 1) if step is None else step
            try:
                fig = overlay_figure(llm.trace(orig.request_id), llm.trace(edited.request_id),
                                     step, decode)
            except KeyError:        # a trace evicted meanwhile: the table still says it all
                fig = None
            return md, plot_value(fig)
        except (ValueError, RuntimeError) as e:
            return f"**Cannot compare:** {html.escape(str(e))}", None

    inputs = [conversation, box, system, max_tokens, kind, layer, ids, prompt_a, prompt_b,
              scale, positions]
    run.click(on_compare, inputs, [out, plot], api_name="compare_intervention")
    try_this.wire(tries, hub, [kind, layer, ids, prompt_a, prompt_b, scale, positions, box,
                               system, accordion], (on_compare, inputs, [out, plot]))
    return WhatIf(accordion, kind, layer, ids, on_compare, inputs, [out, plot], help_md)


def rerun_button() -> gr.Button:
    """For the Layers tab, under its head picker."""
    return gr.Button("Re-run the chat's last message without this head (compare in Chat)",
                     size="sm", variant="secondary", elem_id="iv-from-layers")


def expert_pick(point: dict) -> tuple[int, int] | None:
    """A click on the routing chart ({x: expert, y: "L3"}) -> (layer, expert), or None."""
    try:
        label, x = str(point.get("y", "")), point.get("x")
        if not label.startswith("L") or x is None:
            return None
        return int(label[1:]), int(round(float(x)))
    except (TypeError, ValueError):
        return None


def rerun_expert_button() -> gr.Button:
    """For the Layers tab: armed by a click on the routing chart."""
    return gr.Button("Click an expert in the routing chart to re-run without it", size="sm",
                     variant="secondary", interactive=False, elem_id="iv-expert-from-layers")


def wire_expert_from_layers(routing_plot, button: gr.Button, whatif: WhatIf, tabs: gr.Tabs,
                            chat_tab_id: str = "chat") -> None:
    """A click on a routing cell arms `button`; the button masks that expert at that layer in
    the What-if form, opens the Chat tab and runs the comparison."""
    picked = gr.State(None)

    def on_pick(evt: gr.EventData):
        pick = expert_pick(getattr(evt, "_data", None) or {})
        if pick is None:
            return gr.skip(), gr.skip()
        return pick, gr.Button(f"Re-run the chat's last message without layer {pick[0]} "
                               f"expert {pick[1]} (compare in Chat)", interactive=True)
    routing_plot.click(on_pick, None, [picked, button], api_visibility="private", queue=False)

    def fill(pick):
        if pick is None:
            raise gr.Error("Click an expert in the routing chart first.")
        return ("mask experts", pick[0], str(pick[1]), gr.Accordion(open=True),
                gr.Tabs(selected=chat_tab_id))
    button.click(fill, [picked], [whatif.kind, whatif.layer, whatif.ids, whatif.accordion, tabs],
                 api_visibility="private", queue=False).then(
        whatif.compare, whatif.inputs, whatif.outputs, api_visibility="private")


def wire_from_layers(button: gr.Button, layer_dd, head_dd, whatif: WhatIf, tabs: gr.Tabs,
                     chat_tab_id: str = "chat") -> None:
    """The Layers tab's chosen (layer, head): fill the What-if form with an ablation of it, open
    the Chat tab and its accordion, and run the comparison."""
    def fill(layer_id, head_id):
        if layer_id is None or head_id is None:
            raise gr.Error("Pick a layer and a head first (or click one in the heads grid).")
        return ("ablate heads", int(layer_id), str(int(head_id)), gr.Accordion(open=True),
                gr.Tabs(selected=chat_tab_id))
    button.click(fill, [layer_dd, head_dd],
                 [whatif.kind, whatif.layer, whatif.ids, whatif.accordion, tabs],
                 api_visibility="private", queue=False).then(
        whatif.compare, whatif.inputs, whatif.outputs, api_visibility="private")
