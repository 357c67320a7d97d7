"""KV-cache tab: the block grid, block tables, usage and prefix hits over time, the physical
layout, a data-plane drilldown (K or V of one block), and a shared-prefix burst to watch."""
from __future__ import annotations

import threading
import time
from pathlib import Path

import gradio as gr

from engine import SamplingParams
from views import figures as F
from views.live import LIVE_SNAPSHOT_AGE_S, TICK_IDLE_S, EngineHub, LiveTab, pace
from views.live_plot import live_plot, plot_value
from views.engine_timeline import fold

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


MAX_BURST = 16              # requests in one burst (the slider's maximum)
MAX_BURST_TOKENS = 1024     # tokens each
_burst_lock = threading.Lock()


def fire_burst(hub: EngineHub, n: int, max_tokens: int = 128, warm_timeout_s: float = 5.0
               ) -> list[str]:
    """Start `n` requests that share BURST_SYSTEM.

    The first one runs alone until its prompt is in the cache (its first token), then the rest
    start at once: they hit the prefix cache and share its blocks (ref count > 1), the way a
    served system prompt is shared. `ignore_eos` keeps them running long enough to watch.
    Bounded: at most MAX_BURST requests of MAX_BURST_TOKENS, one burst at a time per server,
    and no thread per request (the engine calls back; nothing waits on a stream).
    """
    n, max_tokens = int(n), int(max_tokens)
    if not 1 <= n <= MAX_BURST or not 1 <= max_tokens <= MAX_BURST_TOKENS:
        raise ValueError(f"a burst is 1 to {MAX_BURST} requests of 1 to {MAX_BURST_TOKENS} "
                         f"tokens; got {n} of {max_tokens}")
    llm = hub.llm
    sp = SamplingParams(temperature=0.8, max_tokens=max_tokens, ignore_eos=True)
    warm = threading.Event()
    errors: list[str] = []
    with _burst_lock:
        live: set = hub.__dict__.setdefault("burst_live", set())
        if live:
            raise ValueError(f"a burst is still running ({len(live)} requests): wait for it "
                             "to finish")
        ids = [hub.new_request_id("burst") for _ in range(n)]
        live.update(ids)

    def on_event(ev, rid):         # on the engine thread, with its lock held: quick
        if isinstance(ev, BaseException):
            errors.append(str(ev))
            live.discard(rid)
        elif ev.finished:
            live.discard(rid)
        warm.set()

    for i, rid in enumerate(ids):
        msgs = [{"role": "system", "content": BURST_SYSTEM},
                {"role": "user", "content": BURST_QUESTIONS[i % len(BURST_QUESTIONS)]}]
        try:
            llm.submit(msgs, sp, request_id=rid, on_event=lambda ev, rid=rid: on_event(ev, rid))
        except Exception as e:      # the model was switched under it, or bad settings
            live.difference_update(ids[i:])
            raise ValueError(f"the burst could not start: {e}") from None
        if i == 0:
            warm.wait(warm_timeout_s)
            if errors:
                live.difference_update(ids)
                raise ValueError(f"the burst could not start: {errors[0]}")
    return ids


def _stats_line(snap) -> str:
    used = snap.num_blocks - snap.num_free_blocks
    evictable = int(snap.block_evictable.sum())
    shared = int((snap.block_ref > 1).sum())
    return (f"**{used}/{snap.num_blocks}** blocks in use ({snap.usage:.0%}) · **{shared}** shared"
            f" · **{evictable}** cached-free (evictable) · prefix hits "
            f"**{snap.prefix_hits}/{snap.prefix_queries}** ({snap.prefix_hit_rate:.0%}) · "
            f"{snap.evictions} evictions · {snap.preemptions} preemptions · "
            f"{len(snap.running)} running, {len(snap.waiting)} waiting")


def state_key(snap) -> tuple:
    """Changes whenever anything the map, tables or stats show can have changed."""
    return (snap.steps[-1].step_id if snap.steps else -1, snap.num_free_blocks,
            snap.prefix_hits, snap.evictions, len(snap.running), len(snap.waiting),
            snap.num_blocks, snap.model_name)


MAP_TEMPLATE = ('<div class="kv-map"><div class="kv-legend"></div>'
                '<canvas class="kv-canvas"></canvas><div class="kv-note"></div>'
                '<div class="kv-tip"></div></div>')
MAP_JS = (Path(__file__).with_name("kv_map.js")).read_text()
def kv_help(block_size: int) -> str:
    """The tab's "What this shows" line, with this engine's block size in it; it names the
    marks the map's legend (views/kv_map.js) draws, in the same words."""
    return (f"**What this shows:** the paged KV cache. Each cell is one physical block of "
            f"{block_size} token slots; a block holds the keys and values of those tokens for "
            "every layer (L × 2 regions: see Anatomy §3). Colour = the request that owns it, "
            "height of the fill = slots written, a dark border with a white dot = shared by "
            "several requests (a cached prefix), hatching = free but still holding a reusable "
            "prefix (hidden until you tick *show* in the legend). Hover a block for its text; "
            "click it for its numbers.")


DRILL_HINT = ("Click a block in the map (or type its id) to see its K or V numbers: one row per "
              "token slot, one column per head dimension.")


def map_value(snap, version: int = 0) -> str:
    """The map's value: its JSON as a string (Gradio's page clones an object value through
    its reactive proxies on every event; a string is one cheap copy)."""
    return F.kv_map_json(F.kv_map_data(snap, version))


def build(hub: EngineHub) -> LiveTab:
    """The KV tab's components and events; returns its timer and refresh."""
    timer = gr.Timer(TICK_IDLE_S, active=False)
    last = gr.State({})
    gr.Markdown(kv_help(hub.llm.block_size), elem_classes=["gb-help"], elem_id="kv-help")
    stats = gr.Markdown("", elem_id="kv-stats")
    with gr.Row(visible=getattr(hub, "burst_enabled", True)):      # --no-burst hides it
        burst_n = gr.Slider(2, MAX_BURST, 6, step=1, label="requests in burst", scale=1,
                            elem_id="kv-burst-n")
        burst_tokens = gr.Slider(8, MAX_BURST_TOKENS, 128, step=8, label="tokens each", scale=1,
                                 elem_id="kv-burst-tokens")
        burst = gr.Button("Fire shared-prefix burst", variant="primary", scale=1,
                          elem_id="kv-burst")
        burst_status = gr.Markdown("", elem_id="kv-burst-status")

    def block_detail(block_id: int) -> str:
        """The hover card of one block (called from the map's script): this block's state and
        text, read from the engine on demand."""
        try:
            llm = hub.llm
            return F.block_detail(llm.block_info(int(block_id)), llm.block_size, hub.decode)
        except Exception as e:       # a hover must never raise into the page (a switch, ...)
            return f"block {block_id}: {e}"

    grid = gr.HTML(map_value(hub.snapshot()), html_template=MAP_TEMPLATE, js_on_load=MAP_JS,
                   server_functions=[block_detail], elem_id="kv-grid", min_height=120)
    with gr.Row():
        with gr.Column(scale=1):
            tables = gr.HTML("", elem_id="kv-tables")
        with gr.Column(scale=1):
            usage = live_plot("kv-usage")
    layout = gr.Markdown("", elem_id="kv-layout")
    with gr.Accordion("Drilldown: the numbers in one block", open=True, elem_id="kv-drill"):
        with gr.Row():
            block = gr.Number(None, label="block id", precision=0, minimum=0,
                              elem_id="kv-drill-block")
            layer = gr.Number(0, label="layer", precision=0, minimum=0,
                              elem_id="kv-drill-layer")
            head = gr.Number(0, label="KV head", precision=0, minimum=0, elem_id="kv-drill-head")
            which = gr.Radio(["k", "v"], value="k", label="K or V", elem_id="kv-drill-which")
            show = gr.Button("Show block", elem_id="kv-drill-show")
        drill = live_plot("kv-block-plot", F.empty_figure(DRILL_HINT, "K or V of one block"))

    def tick(last_keys: dict):
        if hub.switching:
            return {last: last_keys}
        snap = hub.snapshot(max_age=LIVE_SNAPSHOT_AGE_S)
        fold(hub, snap)              # the Engine tab's history keeps counting meanwhile
        now = time.time()
        key = state_key(snap)
        out = {}
        if key != last_keys.get("state"):
            out[stats] = _stats_line(snap)
            out[grid] = map_value(snap, key[0])
            tables_html = F.block_tables_html(snap)
            if tables_html != last_keys.get("tables"):
                out[tables] = tables_html
        # the usage plot scrolls with time: once a second is enough
        if (key, int(now)) != last_keys.get("usage") and now - last_keys.get("usage_t", 0) >= 1:
            out[usage] = plot_value(F.kv_usage_figure(snap, list(hub.hit_history), now))
            last_keys = {**last_keys, "usage": (key, int(now)), "usage_t": now}
        if (snap.num_blocks, snap.model_name) != last_keys.get("layout"):
            out[layout] = F.kv_layout_markdown(snap.kv_layout, snap.block_size)
        keys = {**last_keys, "state": key, "tables": out.get(tables, last_keys.get("tables")),
                "layout": (snap.num_blocks, snap.model_name)}
        pace(timer, keys, snap, out)
        out[last] = keys
        return out

    outputs = {stats, grid, tables, usage, layout, last, timer}
    # queue=False: two status messages per tick instead of four (each one costs the page a
    # pass over every output component's props)
    timer.tick(tick, last, outputs, api_visibility="private", trigger_mode="once",
               show_progress="hidden", show_progress_on=[last], queue=False)  # views/live.py

    def on_burst(n, max_tokens):
        try:
            if not getattr(hub, "burst_enabled", True):     # --no-burst: refused, not hidden only
                raise ValueError("the burst is turned off on this server (--no-burst)")
            ids = fire_burst(hub, int(n), int(max_tokens))
        except ValueError as e:
            gr.Warning(str(e))
            return f"**Burst not fired:** {e}"
        return f"fired {len(ids)} requests sharing a {len(BURST_SYSTEM.split())}-word system prompt"

    burst.click(on_burst, [burst_n, burst_tokens], burst_status, api_visibility="private")

    def on_show(block_id, layer_id, head_id, kv, request: gr.Request = None):
        llm = hub.llm
        cfg = llm.hf_config
        n_kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        for name, value, top in (("block id", block_id, llm.num_kv_blocks),
                                 ("layer", layer_id, cfg.num_hidden_layers),
                                 ("KV head", head_id, n_kv)):
            if value is None or value == "":
                msg = f"Type a {name} first (0 to {top - 1}), or click a block in the map."
                gr.Warning(msg)
                return gr.skip(), plot_value(F.empty_figure(msg, "K or V of one block"))
            if not 0 <= int(value) < top:
                msg = f"{name} {int(value)} is out of range: this model has 0 to {top - 1}."
                gr.Warning(msg)
                return gr.skip(), plot_value(F.empty_figure(msg, "K or V of one block"))
        b, l, h = int(block_id), int(layer_id), int(head_id)
        try:
            # the viewer's own salted blocks show; another client's never (#48: not its text,
            # nor the K/V numbers that encode it)
            info = llm.block_info(b, hub.session_salt(getattr(request, "session_hash", None)))
        except (ValueError, RuntimeError):   # switched or shut down meanwhile
            info = None
        if info is not None and info.hidden:
            msg = (f"Block {b} belongs to a private request (sent with a cache_salt): its "
                   f"numbers and text are not shown to other viewers.")
            return b, plot_value(F.empty_figure(msg, "K or V of one block"))
        try:
            data = llm.read_kv_block(b, l, h, which=kv)      # [block_size, head_dim]
        except (ValueError, IndexError, RuntimeError) as e:
            gr.Warning(f"Cannot show that block: {e}")
            return gr.skip(), gr.skip()
        texts = [hub.decode([t]) for t in info.token_ids] if info else []
        return b, plot_value(F.kv_block_figure(data, b, l, h, kv, texts))

    drill_inputs = [block, layer, head, which]
    show.click(on_show, drill_inputs, [block, drill], api_visibility="private")

    def on_map_click(layer_id, head_id, kv, evt: gr.EventData, request: gr.Request = None):
        return on_show(evt._data.get("block"), layer_id, head_id, kv, request)

    grid.click(on_map_click, [layer, head, which], [block, drill], api_visibility="private")
    return LiveTab(timer, tick, [last], [stats] + [o for o in outputs if o is not stats])
