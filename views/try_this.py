"""The What-if form's "Try this" list: on a demo checkpoint, the interventions whose effect
shows (views/found_effects.py finds them), one button each; a click fills the form, the
message box and the system prompt they were found with, and runs the comparison.

A page's list fills itself when the search ends (a slow timer, skipping when nothing changed)
and follows a model switch. A real checkpoint shows no list.
"""
from __future__ import annotations

from typing import NamedTuple

import gradio as gr

from views.chat import DEMO_SYSTEM
from views.found_effects import FoundEffects

MAX_SHOWN = 6            # buttons made; the search finds at most five effects
POLL_S = 2.0
SEARCHING = ("Searching this demo for interventions whose effect shows (tools/"
             "find_interventions.py, once per checkpoint; about half a minute)…")


def effect_label(e: dict) -> str:
    """One line: what the click does, and the change it makes."""
    what = (f"steer at layer {e['layer']} ×{e['scale']:g} along {e['prompt_a']!r} − "
            f"{e['prompt_b']!r}" if e["kind"] == "steer" else
            f"{e['kind'].split()[0]} {e['kind'].split()[1][:-1]} {e['ids']} at layer "
            f"{e['layer']}")
    return f"{what} · {e['message']!r}: {e['before']!r} → {e['after']!r}"


def status_text(found) -> str:
    if found is None:
        return SEARCHING
    if isinstance(found, str):
        return found
    if not found:
        return "The search found no single intervention that changes a demo reply."
    return ("**Try this:** effects found on this checkpoint (with the demo's system prompt); "
            "a click fills the form and compares.")


class TryThis(NamedTuple):
    column: gr.Column
    buttons: list
    status: gr.Markdown


def found_store(hub) -> FoundEffects:
    """The hub's one store of found effects (made on first use), its search started for the
    loaded checkpoint when that is a demo."""
    store = hub.__dict__.setdefault("found_effects", FoundEffects(DEMO_SYSTEM))
    if hub.is_demo():
        store.start(hub.llm.model_path, hub.llm_kwargs)
    return store


def build(hub) -> TryThis:
    """The list's components, inside the caller's column. The search starts when a page first
    asks for it (or at the command line's start, app.main), not here: an app built for API
    tests never pays for it."""
    with gr.Column(visible=hub.is_demo(), elem_id="iv-try", min_width=240) as column:
        status = gr.Markdown(SEARCHING, elem_id="iv-try-status")
        buttons = [gr.Button("", visible=False, size="sm", variant="secondary",
                             elem_id=f"iv-try-{i}", elem_classes=["gb-try"])
                   for i in range(MAX_SHOWN)]
    return TryThis(column, buttons, status)


def wire(parts: TryThis, hub, fills: list, run) -> None:
    """`fills`: the components a click sets (kind, layer, ids, prompt A, prompt B, scale,
    positions, message box, system prompt, accordion); `run`: (fn, inputs, outputs) of the
    comparison it then runs."""
    shown = gr.State(None)
    outputs = [parts.column, parts.status, *parts.buttons, shown]

    def tick(seen):
        demo = hub.is_demo()
        found = found_store(hub).get(hub.llm.model_path) if demo else []
        key = (hub.generation, demo, repr(found))
        if key == seen:
            return [gr.skip()] * len(outputs)
        effects = found if isinstance(found, list) else []
        buttons = [gr.Button(effect_label(effects[i]), visible=True) if i < len(effects)
                   else gr.Button(visible=False) for i in range(MAX_SHOWN)]
        return [gr.Column(visible=demo), status_text(found), *buttons, key]

    gr.Timer(POLL_S).tick(tick, shown, outputs, api_visibility="private", queue=False,
                          show_progress="hidden", show_progress_on=[shown])

    def fill(i: int):
        found = found_store(hub).get(hub.llm.model_path)
        if not isinstance(found, list) or i >= len(found):
            raise gr.Error("That effect is gone (the model was switched): pick another.")
        e = found[i]
        return (e["kind"], e["layer"], e["ids"] or "0", e["prompt_a"], e["prompt_b"],
                e["scale"] or 2.0, "all", e["message"], DEMO_SYSTEM, gr.Accordion(open=True))

    fn, inputs, outs = run
    for i, b in enumerate(parts.buttons):
        b.click(lambda i=i: fill(i), None, fills, api_visibility="private", queue=False,
                show_progress="hidden").then(fn, inputs, outs, api_visibility="private")
