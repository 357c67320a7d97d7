"""canvas_chart: a Layers-tab chart drawn on a canvas (views/canvas_chart.js) from a compact spec.

The Layers tab redraws four charts per new token; as plotly figures those cost 300-400 ms of the
browser's main thread per update on two cores (axes, legends, label measuring), as canvas
drawings a few milliseconds. Specs are plain dicts built by views/figures_layers.py:
{"kind": "heatmap" | "bars", "title", "height", ...} or {"title", "message"} for an empty chart.
"""
from __future__ import annotations

import base64
from pathlib import Path

import numpy as np

import plotly.colors as pc

from views.live_plot import plot_value

TEMPLATE = '<div class="gb-chart"><canvas></canvas><div class="gb-chart-tip"></div></div>'
# the label-box bookkeeping first: its functions are the chart's too (views/text_boxes.js)
JS = (Path(__file__).with_name("text_boxes.js").read_text()
      + Path(__file__).with_name("canvas_chart.js").read_text())


def _stops(colours: list[str], reverse: bool = False) -> list[list]:
    colours = list(reversed(colours)) if reverse else list(colours)
    n = len(colours) - 1
    return [[i / n, c] for i, c in enumerate(colours)]


VIRIDIS = _stops(pc.sequential.Viridis)
MAGMA_R = _stops(pc.sequential.Magma, reverse=True)
BLUES = _stops(pc.sequential.Blues)
PURPLES = _stops(pc.sequential.Purples)
YLORRD = _stops(pc.sequential.YlOrRd)


PACK_MIN_CELLS = 256      # a heatmap's z with more cells than this travels packed


def pack_matrix(z) -> dict:
    """A numeric matrix as {"b64", "rows", "cols"}: little-endian float32 in base64 (NaN kept,
    the page reads it as null). Encoding 10k numbers this way costs ~0.1 ms of the server's
    Python (and its GIL, which the engine's thread shares) where JSON numbers cost ~10 ms."""
    a = np.ascontiguousarray(np.asarray(z, dtype="<f4"))
    return {"b64": base64.b64encode(a.tobytes()).decode("ascii"), "rows": int(a.shape[0]),
            "cols": int(a.shape[1]) if a.ndim > 1 else 0}


def unpack_matrix(m: dict) -> np.ndarray:
    """pack_matrix's inverse (tests read what the page reads)."""
    a = np.frombuffer(base64.b64decode(m["b64"]), dtype="<f4")
    return a.reshape(m["rows"], m["cols"]) if m["cols"] else a


def chart_value(spec: dict | None) -> str | None:
    """A chart's value: its spec as a JSON string (NaN as null); a large heatmap's z packed
    (pack_matrix; views/canvas_chart.js unpacks it)."""
    if spec is not None and not isinstance(spec, str) and spec.get("kind") == "heatmap":
        z = spec.get("z")
        if isinstance(z, np.ndarray) and z.ndim == 2 and z.size > PACK_MIN_CELLS:
            spec = {**spec, "z": pack_matrix(z)}
    return plot_value(spec)


def canvas_chart(elem_id: str, spec: dict | None = None) -> "gr.HTML":
    """A chart component; its .click gets {row, col, x, y} of the clicked heatmap cell."""
    import gradio as gr      # here, not at import: the figure builders run without Gradio
    return gr.HTML(chart_value(spec), html_template=TEMPLATE, js_on_load=JS, elem_id=elem_id,
                   elem_classes=["gb-canvas-chart"])


def empty_chart(message: str, title: str = "", height: int = 200) -> dict:
    """A chart that says why it is empty."""
    return {"title": title, "message": message, "height": height}
