"""KV-cache tab: the block grid, block tables, usage and prefix hits over time, the physical
layout, a data-plane drilldown (K or V of one block), and a shared-prefix burst to watch."""
from __future__ import annotations

import threading
import time

import gradio as gr

from engine import SamplingParams
from views import figures as F
from views.live import EngineHub

TICK_S = 0.4
BURST_SYSTEM = (
    "You are the tour guide of a small museum of computing history. The museum has three "
    "rooms: the first shows mechanical calculators and punched cards, the second shows early "
    "transistor machines and core memory, and the third shows personal computers from the "
    "nineteen eighties. Answer visitors in two or three friendly sentences.")
BURST_QUESTIONS = [
    "Where are the punched cards?", "What is core memory?", "Which room is the oldest?",
    "Can I touch the machines?", "What came after transistors?", "Is there a gift shop?",
    "Which computer is the most famous?", "How long is the tour?",
]


def fire_burst(hub: EngineHub, n: int, max_tokens: int = 128, warm_timeout_s: float = 5.0
               ) -> list[str]:
    """Start `n` requests that share BURST_SYSTEM, each on its own thread.

    The first one runs alone until its prompt is in the cache (its first token), then the rest
    start at once: they hit the prefix cache and share its blocks (ref count > 1), the way a
    served system prompt is shared. `ignore_eos` keeps them running long enough to watch.
    """
    llm = hub.llm
    sp = SamplingParams(temperature=0.8, max_tokens=int(max_tokens), ignore_eos=True)
    warm = threading.Event()
    errors: list[str] = []
    ids = []
    for i in range(n):
        rid = hub.new_request_id("burst")
        msgs = [{"role": "system", "content": BURST_SYSTEM},
                {"role": "user", "content": BURST_QUESTIONS[i % len(BURST_QUESTIONS)]}]
        events = llm.stream(msgs, sp, request_id=rid)

        def run(events=events):
            try:
                for _ in events:
                    warm.set()
            except Exception as e:   # bad settings, or the model was switched under it
                errors.append(str(e))
            finally:
                warm.set()
        threading.Thread(target=run, name=f"glassbox-{rid}", daemon=True).start()
        ids.append(rid)
        if i == 0:
            warm.wait(warm_timeout_s)
            if errors:
                raise ValueError(f"the burst could not start: {errors[0]}")
    return ids


def _stats_line(snap) -> str:
    used = snap.num_blocks - snap.num_free_blocks
    evictable = sum(1 for b in snap.blocks if b.evictable)
    shared = sum(1 for b in snap.blocks if b.ref_count > 1)
    return (f"**{used}/{snap.num_blocks}** blocks in use ({snap.usage:.0%}) · **{shared}** shared"
            f" · **{evictable}** cached-free (evictable) · prefix hits "
            f"**{snap.prefix_hits}/{snap.prefix_queries}** ({snap.prefix_hit_rate:.0%}) · "
            f"{snap.evictions} evictions · {snap.preemptions} preemptions · "
            f"{len(snap.running)} running, {len(snap.waiting)} waiting")


def build(hub: EngineHub) -> gr.Timer:
    """The KV tab's components and events; returns its timer (activated when the tab shows)."""
    timer = gr.Timer(TICK_S, active=False)
    last = gr.State({})
    stats = gr.Markdown("", elem_id="kv-stats")
    with gr.Row():
        burst_n = gr.Slider(2, 16, 6, step=1, label="requests in burst", scale=1,
                            elem_id="kv-burst-n")
        burst_tokens = gr.Slider(8, 1024, 128, step=8, label="tokens each", scale=1,
                                 elem_id="kv-burst-tokens")
        burst = gr.Button("Fire shared-prefix burst", variant="primary", scale=1,
                          elem_id="kv-burst")
        burst_status = gr.Markdown("", elem_id="kv-burst-status")
    grid = gr.HTML("", elem_id="kv-grid", min_height=120)
    with gr.Row():
        with gr.Column(scale=1):
            tables = gr.HTML("", elem_id="kv-tables")
        with gr.Column(scale=1):
            usage = gr.Plot(show_label=False, elem_id="kv-usage")
    layout = gr.Markdown("", elem_id="kv-layout")
    with gr.Accordion("Drilldown: the numbers in one block", open=True):
        with gr.Row():
            block = gr.Number(0, label="block id", precision=0, minimum=0,
                              elem_id="kv-drill-block")
            layer = gr.Number(0, label="layer", precision=0, minimum=0,
                              elem_id="kv-drill-layer")
            head = gr.Number(0, label="KV head", precision=0, minimum=0, elem_id="kv-drill-head")
            which = gr.Radio(["k", "v"], value="k", label="K or V", elem_id="kv-drill-which")
            show = gr.Button("Show block", elem_id="kv-drill-show")
        drill = gr.Plot(show_label=False, elem_id="kv-block-plot")

    def tick(last_keys: dict):
        snap = hub.snapshot()
        now = time.time()
        last_step = snap.steps[-1].step_id if snap.steps else -1
        state_key = (last_step, snap.num_free_blocks, snap.prefix_hits, snap.evictions,
                     tuple(snap.block_tables), tuple(snap.running), tuple(snap.waiting))
        keys = {"state": state_key, "usage": (state_key, int(now)), "layout": snap.num_blocks}
        out = {}
        if keys["state"] != last_keys.get("state"):
            out[stats] = _stats_line(snap)
            out[grid] = F.kv_grid_html(snap, hub.decode)
            out[tables] = F.block_tables_html(snap)
        if keys["usage"] != last_keys.get("usage"):
            out[usage] = F.kv_usage_figure(snap, list(hub.hit_history), now)
        if keys["layout"] != last_keys.get("layout"):
            out[layout] = F.kv_layout_markdown(snap.kv_layout, snap.block_size)
        out[last] = keys
        return out

    timer.tick(tick, last, {stats, grid, tables, usage, layout, last},
               api_visibility="private", trigger_mode="once", show_progress="hidden")

    def on_burst(n, max_tokens):
        try:
            ids = fire_burst(hub, int(n), int(max_tokens))
        except ValueError as e:
            gr.Warning(str(e))
            return f"⚠️ {e}"
        return f"fired {len(ids)} requests sharing a {len(BURST_SYSTEM.split())}-word system prompt"

    burst.click(on_burst, [burst_n, burst_tokens], burst_status, api_visibility="private")

    def on_show(block_id, layer_id, head_id, kv):
        llm = hub.llm
        try:
            b, l, h = int(block_id), int(layer_id), int(head_id)
            data = llm.read_kv_block(b, l, h, which=kv)      # [block_size, head_dim]
        except (ValueError, TypeError, IndexError, RuntimeError) as e:
            gr.Warning(f"Cannot show that block: {e}")
            return gr.skip()
        snap = hub.snapshot()
        info = next((x for x in snap.blocks if x.block_id == b), None)
        texts = [hub.decode([t]) for t in info.token_ids] if info else []
        return F.kv_block_figure(data, b, l, h, kv, texts)

    show.click(on_show, [block, layer, head, which], drill, api_visibility="private")
    return timer
