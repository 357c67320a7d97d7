"""Shared look for every figure: fixed request colours, one-call figure construction, shapes.

Figures are plotly's JSON as plain dicts ({"data": [trace, ...], "layout": {...}}), not
plotly.graph_objects: building and validating graph objects costs 20-100 ms a figure on the
2-core machine, a dict a millisecond or two, and live tabs rebuild several a second. Plotly.js
validates what it draws anyway; tests check the dicts.
"""
from __future__ import annotations

import functools
import re
import zlib


# 32 request colours, each >= 27 CIELAB ΔE76 from every other and from the free, evictable and
# shared-outline greys (chosen greedily, max-min distance, from an RGB grid with lightness 30-78
# and chroma > 35; tests/test_figures_palette.py checks it): a busy cache with dozens of
# requests keeps them apart, and sequential ids (trailing counters) get the most distinct first.
PALETTE = [
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#0000ff", "#ff46d1", "#745d00", "#5d5de8",
    "#8b2e5d", "#00d1b9", "#d1b900", "#ffa28b", "#e8a2e8", "#175d2e", "#d117ff", "#a2b974",
    "#ff0074", "#00d1ff", "#8b00a2", "#00d100", "#8b462e", "#5d468b", "#a2d100", "#008bff",
    "#e8a246", "#748b00", "#ff74a2", "#a2b9ff", "#d174ff", "#5d17d1", "#ff0000", "#b946a2",
]
FREE_COLOUR = "#e9ecef"
EVICTABLE_COLOUR = "#adb5bd"
PREFILL_COLOUR = "#f28e2b"
DECODE_COLOUR = "#4e79a7"
PHASE_COLOURS = {"schedule": "#76b7b2", "prepare": "#edc948", "forward": "#4e79a7",
                 "sample": "#e15759"}
# sqrt colour scale for probabilities: small attention weights stay visible, range fixed [0, 1]
PROB_TICKS = [0.0, 0.05, 0.2, 0.5, 1.0]     # sqrt-spaced >= 0.22 apart: never overlap
FONT = dict(family="Inter, system-ui, sans-serif", size=12)


@functools.lru_cache(maxsize=4096)
@functools.lru_cache(maxsize=8192)     # every tick colours every request (~1 µs of regex each, 256 a tick)
def request_colour(request_id: str) -> str:
    """Stable colour per request: trailing digits (sequential ids) pick distinct colours."""
    m = re.search(r"(\d+)$", request_id)
    n = int(m.group(1)) if m else zlib.crc32(request_id.encode())
    return PALETTE[n % len(PALETTE)]


Figure = dict     # plotly figure JSON: {"data": [trace, ...], "layout": {...}}


def heatmap(**kw) -> dict:
    if isinstance(kw.get("colorbar"), dict):      # see make_figure: no label measuring
        kw["colorbar"] = _titled({"ticklabeloverflow": "allow", **kw["colorbar"]})
    return {"type": "heatmap", **kw}


def scatter(**kw) -> dict:
    return {"type": "scatter", **kw}


def bar(**kw) -> dict:
    if "marker_color" in kw:
        kw["marker"] = {"color": kw.pop("marker_color")}
    return {"type": "bar", **kw}


def make_figure(traces: list, title: str, uirevision: str, height: int = 320,
                **layout) -> Figure:
    """A figure with fixed fonts and margins; `uirevision` keeps the user's zoom across live
    updates (views/live_plot.js draws it with Plotly.react).

    Every axis gets ticklabeloverflow "allow": plotly's default ("hide past div") measures
    each tick label's box on every redraw, which was the largest single cost of a live update.
    No legends: plotly re-measures them on every redraw too; a figure names its series in its
    title (legend_title) instead."""
    # plotly.js anchors a multi-line title by its first line: each further line (a legend
    # line from legend_title) would push the title above the top edge; pad it down by them
    pad = 8 + 17 * title.count("<br>")
    base = dict(title=dict(text=title, x=0.01, y=1, yanchor="top", pad=dict(t=pad),
                           font=dict(size=14)),
                font=FONT, height=height, margin=dict(l=60, r=20, t=40, b=40),
                uirevision=uirevision, plot_bgcolor="white", paper_bgcolor="white",
                showlegend=False)
    base.update(layout)
    for name in [k for k in base if k.startswith(("xaxis", "yaxis"))] + ["xaxis", "yaxis"]:
        base[name] = _titled({"ticklabeloverflow": "allow", **(base.get(name) or {})})
    return {"data": list(traces), "layout": base}


def _titled(d: dict) -> dict:
    """plotly.js 3+ takes a title only as {"text": ...} (plotly.py used to convert a string)."""
    if isinstance(d.get("title"), str):
        d["title"] = {"text": d["title"]}
    return d


def legend_title(title: str, series: dict[str, str]) -> str:
    """A title that is also the legend: each series name in its colour."""
    keys = " ".join(f'<span style="color:{c}">■</span> {plotly_text(n)}'
                    for n, c in series.items())
    return f"{title}<br><span style=\"font-size:11px\">{keys}</span>"


def empty_figure(message: str, title: str = "", height: int = 260) -> Figure:
    """A blank figure that says why it is blank (no request yet, not an MoE model, ...)."""
    return make_figure(
        [], title, uirevision="empty", height=height,
        annotations=[dict(text=message, showarrow=False, x=0.5, y=0.5, xref="paper",
                          yref="paper", font=dict(size=14, color="#6c757d"))],
        xaxis=dict(visible=False), yaxis=dict(visible=False))


def plotly_text(text: str) -> str:
    """Text for a plotly label, title or hover, which render a subset of HTML: markup in
    token text (`<b>`, `<a href=...>`) shows as typed instead."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def fmt_bytes(n: float) -> str:
    """Bytes in binary units (KiB, MiB, GiB, TiB), the one convention of every tab: the KV
    tab, the Engine tab and Anatomy print the same cache with the same number."""
    n = float(n)
    if abs(n) < 1024:
        return f"{n:.0f} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"
    return f"{n:.1f} TiB"


def short_text(text: str, limit: int = 12) -> str:
    """Token text fit for an axis label: visible whitespace, bounded length."""
    text = text.replace("\n", "⏎").replace("\t", "⇥")
    if text.strip() == "" and text:
        text = text.replace(" ", "·")
    return text if len(text) <= limit else text[: limit - 1] + "…"
