"""Engine tab: the batch timeline, where step time goes, CUDA-graph use, and the TP map."""
from __future__ import annotations

import gradio as gr
import numpy as np

from views import figures as F
from views.live import EngineHub

TICK_S = 0.5


def _stats_line(snap) -> str:
    steps = snap.steps
    if not steps:
        return "No engine steps yet: send a message or fire a burst from the KV cache tab."
    ms = [1e3 * (s.t_schedule + s.t_prepare + s.t_forward + s.t_sample) for s in steps]
    span = steps[-1].wall_time - steps[0].wall_time
    toks = sum(s.num_decode_tokens + s.num_prefill_tokens for s in steps[1:])
    rate = f" · {toks / span:.0f} tok/s over the last {len(steps)} steps" if span > 0 else ""
    return (f"step **{steps[-1].step_id}** · median **{np.median(ms):.1f} ms**/step{rate} · "
            f"{len(snap.running)} running, {len(snap.waiting)} waiting · "
            f"{snap.preemptions} preemptions · {steps[-1].collectives} collectives/step")


def build(hub: EngineHub) -> gr.Timer:
    """The Engine tab's components and events; returns its timer."""
    timer = gr.Timer(TICK_S, active=False)
    last = gr.State({})
    stats = gr.Markdown("", elem_id="engine-stats")
    timeline = gr.Plot(show_label=False, elem_id="engine-timeline")
    with gr.Row():
        with gr.Column(scale=1):
            steptime = gr.Plot(show_label=False, elem_id="engine-steptime")
        with gr.Column(scale=1):
            graphs = gr.Plot(show_label=False, elem_id="engine-graphs")
    tp = gr.Plot(show_label=False, elem_id="engine-tp")

    def tick(last_keys: dict):
        snap = hub.snapshot()
        key = (snap.steps[-1].step_id if snap.steps else -1, len(snap.running),
               len(snap.waiting), snap.model_name)
        if last_keys.get("key") == key:
            return [gr.skip()] * 6
        tp_fig = (F.tp_map_figure(snap.tp_layout, snap.num_heads, snap.num_kv_heads)
                  if last_keys.get("model") != snap.model_name else gr.skip())
        return [_stats_line(snap), F.batch_timeline_figure(snap.steps),
                F.step_time_figure(snap.steps), F.cuda_graph_figure(snap.steps), tp_fig,
                {"key": key, "model": snap.model_name}]

    timer.tick(tick, last, [stats, timeline, steptime, graphs, tp, last],
               api_visibility="private", trigger_mode="once", show_progress="hidden")
    return timer
