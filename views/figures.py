"""Pure figure builders (snapshot / trace -> plotly Figure, canvas chart spec or HTML), one
import for the tabs.

Each builder takes plain records from engine/records.py and engine/probes/trace.py
and returns a figure (or HTML, or the block map's JSON); none touches the engine, so tests build them from synthetic records.
"""
from views.figures_common import empty_figure, request_colour
from views.figures_engine import batch_timeline_figure, cuda_graph_figure, step_time_figure
from views.figures_tp import tp_map_figure
from views.figures_kv import (block_detail, block_state, block_tables_html, kv_block_figure,
                              kv_layout_markdown, kv_map_data, kv_map_json, kv_usage_figure)
from views.figures_layers import (attention_at, attention_heads_figure, attention_row_figure,
                                  attention_step_for, expert_load_figure, lens_hover_text,
                                  logit_lens_figure, norms_figure, routing_figure)

__all__ = [
    "empty_figure", "request_colour",
    "batch_timeline_figure", "cuda_graph_figure", "step_time_figure", "tp_map_figure",
    "block_detail", "block_state", "block_tables_html", "kv_block_figure", "kv_map_data",
    "kv_map_json",
    "kv_layout_markdown", "kv_usage_figure",
    "attention_at", "attention_heads_figure", "attention_row_figure", "attention_step_for",
    "expert_load_figure", "lens_hover_text", "logit_lens_figure", "norms_figure", "routing_figure",
]
