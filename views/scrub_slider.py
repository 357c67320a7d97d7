"""ScrubSlider: a gr.Slider whose typed-in value is passed on, never refused.

Gradio's Slider rejects a number typed past its bounds with a raw toast ("Value 30 is greater
than maximum value 28.") and, since a live tab's timer sends the slider with every tick, with
an HTTP 500 per tick until the slider moves. The handler clamps the value to the tokens there
are and writes it back instead (views/layers.py), so an out-of-range number just snaps.
"""
from __future__ import annotations

import gradio as gr


class ScrubSlider(gr.Slider):
    is_template = True          # the page draws it as a plain Slider

    def preprocess(self, payload: float | None) -> float | None:
        if payload is None:         # an emptied box: the handler keeps the token it has
            return None
        return gr.Number.round_to_precision(payload, self.precision)
