"""Engine tab: the batch timeline, where step time goes, CUDA-graph use (on the GPU) or the
batch per step (on the CPU), a step history that outlives a burst, request latency
percentiles, and the TP map. The step charts and the latency table are one canvas board
(views/step_chart.py): a tick sends one value holding only the charts that changed."""
from __future__ import annotations

import time

import gradio as gr

from views import figures as F
from views.figures_engine import (STEP_WINDOW, graphs_figure, history_figure, latency_table,
                                  step_stats)
from views.live import LIVE_SNAPSHOT_AGE_S, TICK_IDLE_S, EngineHub, LiveTab, pace
from views.live_plot import live_plot, plot_value
from views.step_chart import board_value, step_board
from views.engine_timeline import LATENCY_WINDOW_S, EngineTimeline, fold

IDLE_NOTE_S = 1.0
SLOW_EVERY_S = 1.0      # history (1-second buckets) and latency table: once a second
RATE_SPAN_S = 60.0      # the headline's token rates: busy time of the last minute
HELP = ("**What this shows:** the engine's step loop. Each step runs one batch: chunks of "
        "prompts (prefill) and one new token for each running reply (decode), batched "
        "together (continuous batching). *Batch timeline*: which request ran in which step. "
        "*Step time*: where a step's time went. *History* and *Latency* reach back minutes. "
        "*TP map*: which rank holds which heads (the tensor-parallel head split).")


def stats_line(snap, now: float | None = None, history: EngineTimeline | None = None) -> str:
    """The tab's headline: step, median step time over the plots' window, and token rates
    per busy second over the last minute (from the aggregated history, so a burst's prefill
    still counts after its steps left the engine's ring)."""
    steps = snap.steps
    if not steps:
        return "No engine steps yet: send a message or fire a burst from the KV cache tab."
    st = step_stats(steps, STEP_WINDOW)
    now = time.time() if now is None else now
    idle = now - steps[-1].wall_time
    if history is not None:
        pre, dec, busy = history.rates(now, RATE_SPAN_S)
        rates = (f" · **{dec:.0f}** decode tok/s, **{pre:.0f}** prefill tok/s while busy in the "
                 f"last minute ({busy:.2f} s busy)") if busy > 0 else ""
    else:
        rates = (f" · **{st.decode_tok_s:.0f}** decode tok/s, {st.prefill_tok_s:.0f} prefill "
                 f"tok/s while busy ({st.busy_s:.2f} s busy)") if st.decode_tok_s is not None \
            else ""
    state = (f" · idle for {idle:.0f} s" if idle >= IDLE_NOTE_S and not snap.running
             else f" · {len(snap.running)} running, {len(snap.waiting)} waiting")
    return (f"step **{steps[-1].step_id}** · median **{st.median_ms:.1f} ms**/step over the "
            f"last {st.num_steps} steps{rates}{state} · {snap.preemptions} preemptions · "
            f"{steps[-1].collectives} collectives/step{speculation_note(steps)}")


def speculation_note(steps) -> str:
    """Speculative decoding over the recorded steps: the share of draft tokens accepted, the
    tokens a verify yields (accepted drafts + the target's own) and the host time proposing
    takes per verify; '' when nothing drafted."""
    verifies = sum(len(t.verifies) for t in steps)
    if not verifies:
        return ""
    drafted = sum(t.num_draft_tokens for t in steps)
    accepted = sum(t.num_accepted_tokens for t in steps)
    propose_ms = 1e3 * sum(t.t_propose for t in steps) / verifies
    return (f" · speculative decoding: **{accepted / drafted:.0%}** of {drafted} draft tokens "
            f"accepted, **{(accepted + verifies) / verifies:.2f}** tokens per verify, "
            f"{propose_ms:.2f} ms proposing per verify")


# the board's layout: (slot id, flex weight, chart or table) per row
BOARD = [[("engine-timeline", 1, "chart")],
         [("engine-steptime", 1, "chart"), ("engine-graphs", 1, "chart")],
         [("engine-history", 3, "chart"), ("engine-latency", 2, "table")]]


def build(hub: EngineHub) -> LiveTab:
    """The Engine tab's components and events; returns its timer and refresh."""
    timer = gr.Timer(TICK_IDLE_S, active=False)
    last = gr.State({})
    gr.Markdown(HELP, elem_classes=["gb-help"], elem_id="engine-help")
    stats = gr.Markdown("", elem_id="engine-stats")
    board = step_board("engine-charts", BOARD)
    tp = live_plot("engine-tp")
    # few outputs: Gradio's page does bookkeeping per output of every tick
    outputs = [stats, board, tp, last, timer]

    def tick(last_keys: dict):
        out = {o: gr.skip() for o in outputs}
        if hub.switching:
            return out
        snap = hub.snapshot(max_age=LIVE_SNAPSHOT_AGE_S)
        hist = fold(hub, snap)
        now = time.time()
        keys = dict(last_keys)
        pace(timer, keys, snap, out)
        key = (snap.steps[-1].step_id if snap.steps else -1, len(snap.running),
               len(snap.waiting), snap.model_name)
        idle_s = int(now - snap.steps[-1].wall_time) if snap.steps else 0
        parts = {}
        if keys.get("key") == key:          # idle: only the "idle for" note moves
            if idle_s != keys.get("idle"):
                out[stats] = stats_line(snap, now, hist)
        else:
            if keys.get("model") != snap.model_name:
                out[tp] = plot_value(F.tp_map_figure(snap.tp_layout, snap.num_heads,
                                                     snap.num_kv_heads))
            out[stats] = stats_line(snap, now, hist)
            parts = {"engine-timeline": F.batch_timeline_figure(snap.steps),
                     "engine-steptime": F.step_time_figure(snap.steps),
                     "engine-graphs": graphs_figure(snap)}
        # the minutes-long views move slowly: every SLOW_EVERY_S is enough
        if now - keys.get("slow_t", 0) >= SLOW_EVERY_S:
            parts["engine-history"] = history_figure(hist.series(), now)
            lat = latency_table(hist.latency(now), LATENCY_WINDOW_S)
            if lat != keys.get("latency"):
                parts["engine-latency"] = keys["latency"] = lat
            keys["slow_t"] = now
        if parts:
            out[board] = board_value(parts)
        keys.update(key=key, model=snap.model_name, idle=idle_s)
        out[last] = keys
        return out

    timer.tick(tick, last, outputs, api_visibility="private", trigger_mode="once",
               show_progress="hidden", show_progress_on=[last], queue=False)  # views/live.py
    return LiveTab(timer, tick, [last], outputs)
