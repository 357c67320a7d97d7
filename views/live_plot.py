"""live_plot: a plotly figure in a gr.HTML that keeps its div and updates with Plotly.react.

gr.Plot in Gradio 6.31 re-mounts its plot on every new value (a new div and a full newPlot each
time), which costs the browser several times a react's diff and drops the user's zoom. Live
figures here are gr.HTML components fed the figure's JSON; views/live_plot.js draws them with
the plotly.js bundled in the Python plotly package (served by the app: see ALLOWED_PATHS).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import plotly

try:        # Gradio's own JSON library (always there with the playground); json without it
    import orjson
except ImportError:     # pragma: no cover — a machine without Gradio (the GPU benches)
    orjson = None
# numpy arrays natively (NaN as null, as plotly.js expects), int keys as text like json's
_ORJSON_OPTS = orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS if orjson else 0

PLOTLY_JS = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
ALLOWED_PATHS = [str(PLOTLY_JS)]     # app.launch passes these to Gradio
HEAD = f'<script src="/gradio_api/file={PLOTLY_JS}"></script>'
TEMPLATE = '<div class="gb-plot"></div>'
JS = Path(__file__).with_name("live_plot.js").read_text()


def _json_default(o):
    """numpy in a figure dict: arrays as lists (NaN as null, as plotly.js expects)."""
    if isinstance(o, np.ndarray):
        if o.dtype.kind == "f" and not np.isfinite(o).all():
            return np.where(np.isfinite(o), o, None).tolist()
        if o.dtype.kind == "O":     # mixed values (text beside numbers): any float may be NaN
            return _nan_to_none(o.tolist())
        return o.tolist()
    if isinstance(o, np.generic):
        return _finite(o.item())
    raise TypeError(f"cannot put a {type(o).__name__} in a figure")


def _finite(x):
    return None if isinstance(x, float) and not math.isfinite(x) else x


def _nan_to_none(o):
    if isinstance(o, dict):
        return {k: _nan_to_none(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_nan_to_none(v) for v in o]
    return _finite(o)


def plot_value(fig: dict | None) -> str | None:
    """A live plot's value: the figure dict (views/figures_common.py) as plotly JSON, a string
    (Gradio's page copies a string in one go, an object through its reactive proxies)."""
    if fig is None or isinstance(fig, str):     # None, or a value already serialised
        return fig
    if orjson is not None:
        # ~5x json's speed on a figure: a tick's charts share the GIL with the engine thread
        try:
            return orjson.dumps(fig, default=_json_default, option=_ORJSON_OPTS).decode()
        except TypeError:   # something orjson will not take: json below says what
            pass
    try:
        return json.dumps(fig, default=_json_default, separators=(",", ":"), allow_nan=False)
    except ValueError:      # a NaN in a plain list: the slow, careful way
        return json.dumps(_nan_to_none(fig), default=_json_default, separators=(",", ":"))


def live_plot(elem_id: str, fig: dict | None = None, **kwargs) -> "gr.HTML":
    """A live plot component (its .click gets {x, y, curve} of the clicked point)."""
    import gradio as gr      # here, not at import: the figure builders run without Gradio
    return gr.HTML(plot_value(fig), html_template=TEMPLATE, js_on_load=JS, head=HEAD,
                   elem_id=elem_id, elem_classes=["gb-live-plot"], **kwargs)


def preload_plotly() -> "gr.HTML":
    """An empty component whose head loads plotly.js as soon as the page opens, so the first
    live tab a user opens need not wait for the 4.8 MB script."""
    import gradio as gr      # here, not at import: the figure builders run without Gradio
    return gr.HTML("", head=HEAD, js_on_load=None, elem_id="plotly-preload")
