"""Engine tab: the batch timeline, where step time goes, CUDA-graph use, and the TP map."""
from __future__ import annotations

import time

import gradio as gr

from views import figures as F
from views.figures_engine import STEP_WINDOW, step_stats
from views.live import TICK_IDLE_S, EngineHub, LiveTab, pace
from views.live_plot import live_plot, plot_value

IDLE_NOTE_S = 1.0


def stats_line(snap, now: float | None = None) -> str:
    """The tab's headline: step, median step time and busy-time token rates over the same
    window of steps as the plots (so the median here is the step-time plot's)."""
    steps = snap.steps
    if not steps:
        return "No engine steps yet: send a message or fire a burst from the KV cache tab."
    st = step_stats(steps, STEP_WINDOW)
    now = time.time() if now is None else now
    idle = now - steps[-1].wall_time
    rates = ""
    if st.decode_tok_s is not None:
        rates = (f" · **{st.decode_tok_s:.0f}** decode tok/s, {st.prefill_tok_s:.0f} prefill "
                 f"tok/s while busy ({st.busy_s:.2f} s busy)")
    state = (f" · idle for {idle:.0f} s" if idle >= IDLE_NOTE_S and not snap.running
             else f" · {len(snap.running)} running, {len(snap.waiting)} waiting")
    return (f"step **{steps[-1].step_id}** · median **{st.median_ms:.1f} ms**/step over the "
            f"last {st.num_steps} steps{rates}{state} · {snap.preemptions} preemptions · "
            f"{steps[-1].collectives} collectives/step")


def build(hub: EngineHub) -> LiveTab:
    """The Engine tab's components and events; returns its timer and refresh."""
    timer = gr.Timer(TICK_IDLE_S, active=False)
    last = gr.State({})
    stats = gr.Markdown("", elem_id="engine-stats")
    timeline = live_plot("engine-timeline")
    with gr.Row():
        with gr.Column(scale=1):
            steptime = live_plot("engine-steptime")
        with gr.Column(scale=1):
            graphs = live_plot("engine-graphs")
    tp = live_plot("engine-tp")
    outputs = [stats, timeline, steptime, graphs, tp, last, timer]

    def tick(last_keys: dict):
        out = {o: gr.skip() for o in outputs}
        if hub.switching:
            return out
        snap = hub.snapshot()
        now = time.time()
        keys = dict(last_keys)
        pace(timer, keys, snap, out)
        key = (snap.steps[-1].step_id if snap.steps else -1, len(snap.running),
               len(snap.waiting), snap.model_name)
        idle_s = int(now - snap.steps[-1].wall_time) if snap.steps else 0
        if keys.get("key") == key:          # idle: only the "idle for" note moves
            if idle_s != keys.get("idle"):
                out[stats] = stats_line(snap, now)
        else:
            if keys.get("model") != snap.model_name:
                out[tp] = plot_value(F.tp_map_figure(snap.tp_layout, snap.num_heads,
                                                     snap.num_kv_heads))
            out.update({stats: stats_line(snap, now),
                        timeline: plot_value(F.batch_timeline_figure(snap.steps)),
                        steptime: plot_value(F.step_time_figure(snap.steps)),
                        graphs: plot_value(F.cuda_graph_figure(snap.steps))})
        keys.update(key=key, model=snap.model_name, idle=idle_s)
        out[last] = keys
        return out

    timer.tick(tick, last, outputs, api_visibility="private", trigger_mode="once",
               show_progress="hidden", show_progress_on=[stats], queue=False)  # views/layers.py
    return LiveTab(timer, tick, [last], outputs)
