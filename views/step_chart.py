"""step_chart: a board of canvas charts over steps or time in one gr.HTML (views/step_chart.js).

The Engine tab's four plots were plotly figures, each its own component: a tick sent up to four
values and the page re-laid-out up to four figures, ~140 ms of its main thread per update on two
cores (1.6-2.2 updates/s). Here the board is one component: a tick sends one JSON with only the
slots that changed, and each chart is a canvas drawing of a few ms. Specs are plain dicts built
by views/figures_engine.py:
  {"title", "legend": [[name, colour, "fill" | "line" | "dash"]], "height",
   "x": {"lo": [...], "hi": [...], "values": [...], "range": [a, b], "name", "title", "int"},
   "panels": [{"kind": "stack", "series": [{"name", "colour", "y"}], "lines": [...], ...},
              {"kind": "cells", "rows": [...], "kinds": [[name, colour]],
               "cells": [[i, row, kind, tokens, start]]}]}
  {"title", "message", "height"}                       an empty chart that says why
  {"kind": "table", "title", "head": [...], "rows": [[...]], "note"}
"""
from __future__ import annotations

from html import escape
from pathlib import Path

from views.live_plot import plot_value

# the label-box bookkeeping first: its functions are the chart's too (views/text_boxes.js)
JS = (Path(__file__).with_name("text_boxes.js").read_text()
      + Path(__file__).with_name("step_chart.js").read_text())


def board_template(rows: list[list[tuple[str, float, str]]]) -> str:
    """The board's layout: rows of slots (slot id, flex weight, "chart" | "table"); each slot's
    div carries the slot id as its id, so tests and users find a chart by it."""
    out = ['<div class="gb-board">']
    for row in rows:
        out.append('<div class="gb-board-row">')
        for slot, weight, kind in row:
            inner = ("<canvas></canvas>" if kind == "chart" else "")
            cls = "gb-chart" if kind == "chart" else "gb-table"
            out.append(f'<div class="gb-slot" id="{escape(slot)}" style="flex: {weight} 1 0">'
                       f'<div class="{cls}" data-slot="{escape(slot)}">{inner}</div></div>')
        out.append("</div>")
    out.append("</div>")
    return "".join(out)


def board_value(parts: dict[str, dict]) -> str | None:
    """A tick's value: the slots that changed, {slot id: spec}; None when nothing did."""
    return plot_value(parts) if parts else None


def step_board(elem_id: str, rows: list[list[tuple[str, float, str]]]) -> "gr.HTML":
    import gradio as gr      # here, not at import: the figure builders run without Gradio
    return gr.HTML(None, html_template=board_template(rows), js_on_load=JS, elem_id=elem_id,
                   elem_classes=["gb-step-board"])


def empty_chart(message: str, title: str = "", height: int = 260) -> dict:
    """A chart that says why it is empty."""
    return {"title": title, "message": message, "height": height}
