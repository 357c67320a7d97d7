"""A short guided first run: a few steps that point at the page itself (views/tour.js draws
them), skippable, and remembered per browser so it shows once.

On a demo checkpoint it sends a trained example, shows that reply's blocks on the KV map and
its layers, then the "Try this" list of interventions found on the demo. A real checkpoint gets
the same walk without the demo's example and list: type a message, its blocks, its layers, the
What-if form.
"""
from __future__ import annotations

import json
from pathlib import Path

import gradio as gr

JS = Path(__file__).with_name("tour.js").read_text()
TEMPLATE = '<div class="gb-tour"></div>'
DONE_KEY = "gb-tour-done"           # localStorage: the tour was finished or skipped here
# the header's "Guided tour" button: forget that it was done, and start it on a fresh page
RESTART_JS = f"() => {{ localStorage.removeItem('{DONE_KEY}'); location.reload(); }}"


def tour_steps(demo: bool, block_size: int) -> list[dict]:
    """Each step: the tab to show, the element to point at, what to say; `click`: the element
    "Next" presses for the reader (sending the example, trying the first effect)."""
    first = ({"tab": "chat", "target": "#chat-example-1", "click": "#chat-example-1",
              "text": "This demo model was trained on five small tasks. Next sends one of "
                      "them, “Copy: glass box”, as one engine request, streamed token by "
                      "token."} if demo else
             {"tab": "chat", "target": "#chat-input",
              "text": "Type a message and press Send: each reply is one engine request, "
                      "streamed token by token. Then press Next."})
    # `open`: an accordion to open first, unless `opened` (an element inside it) shows already
    form = {"open": "#iv-accordion", "opened": "#iv-kind"}
    last = ({"tab": "chat", "target": "#iv-try", **form, "click": "#iv-try-0",
             "text": "What if? A search on this demo found interventions whose effect shows. "
                     "Next tries the first: the same message re-run with it, beside the "
                     "untouched reply, and where the two part."} if demo else
            {"tab": "chat", "target": "#iv-accordion", **form,
             "text": "What if? Re-run your last message with attention heads ablated, or the "
                     "residual stream steered, beside the untouched reply; the Layers tab's "
                     "button does it for the head you pick there."})
    return [first,
            {"tab": "kv", "target": "#kv-grid",
             "text": f"Its KV cache: each cell is one physical block of {block_size} token "
                     "slots holding their keys and values, coloured by the request that owns "
                     "it. The tables below list each request's block ids."},
            {"tab": "layers", "target": "#layers-lens",
             "text": "Its layers: the logit lens reads each layer's guess for the next token, "
                     "so you see where the answer forms. Click a column to scrub to a token."},
            last]


def restart_button() -> gr.Button:
    """For the page's header: take the tour again (it runs in the browser only)."""
    button = gr.Button("Guided tour", size="sm", variant="secondary", elem_id="tour-start",
                       scale=0, min_width=120)
    button.click(None, js=RESTART_JS, api_visibility="private", queue=False)
    return button


def build(demo: bool, block_size: int) -> gr.HTML:
    """The tour's (invisible until it runs) element; a page that finished it never sees it."""
    value = json.dumps({"steps": tour_steps(demo, block_size), "key": DONE_KEY})
    return gr.HTML(value, html_template=TEMPLATE, js_on_load=JS, elem_id="tour",
                   padding=False)
