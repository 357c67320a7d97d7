"""The view-layer fixes of the newcomer pass (issue 28), on synthetic snapshots: the Engine
tab's aggregated step history and latencies (each step counted once however often it is
read), the CPU batch panel, a palette that tells 32 requests apart, one byte convention, the
Layers tab's request choice and slider bounds."""
import random
import re
from types import SimpleNamespace

import numpy as np
import pytest

from ui_helpers import make_snapshot  # noqa: I001  (puts the repo on sys.path)
from engine.records import StepEntry, StepTrace
from views.figures_common import EVICTABLE_COLOUR, FREE_COLOUR, PALETTE, fmt_bytes, request_colour
from views.engine_timeline import COARSE, FINE_S, EngineTimeline


def step(i, t, entries, own=0.01):
    pre = sum(e.num_tokens for e in entries if e.kind == "prefill")
    dec = sum(e.num_tokens for e in entries if e.kind == "decode")
    return StepTrace(step_id=i, wall_time=t, entries=entries, num_prefill_tokens=pre,
                     num_decode_tokens=dec, t_schedule=0.0, t_prepare=0.0, t_forward=own,
                     t_sample=0.0, graph_bucket=None, num_running=len(entries), num_waiting=0,
                     kv_usage=0.1)


def snap_of(steps, running=()):
    return SimpleNamespace(steps=list(steps), running=list(running), waiting=[])


def random_run(rng: random.Random, t0: float):
    """Requests arriving over time, each: one prefill step then decode steps; the steps of the
    whole run and the requests still running at its end."""
    steps, t, i, n = [], t0, 0, 0
    live = {}
    for _ in range(rng.randint(20, 200)):
        if rng.random() < 0.2 or not live:
            live[f"r-{n}"] = "prefill"
            n += 1
        entries = []
        for rid, kind in list(live.items()):
            entries.append(StepEntry(rid, kind, 9 if kind == "prefill" else 1, 0))
        own = rng.uniform(0.001, 0.02)
        st = step(i, t, entries, own)
        steps.append(st)
        for e in entries:
            live[e.request_id] = "decode"
            if e.kind == "decode" and rng.random() < 0.1:
                del live[e.request_id]
        t += own + rng.choice([0.0, 0.0, 0.3, 2.0])
        i += 1
    return steps, list(live)


@pytest.mark.parametrize("seed", [random.randrange(1 << 30) for _ in range(3)])
def test_history_counts_each_step_once(seed):
    rng = random.Random(seed)
    steps, still = random_run(rng, 1_000_000.0)
    h = EngineTimeline()
    # read as a live tab does: overlapping windows of the ring, some read twice
    k = 0
    while k < len(steps):
        hi = min(len(steps), k + rng.randint(1, 12))
        ring = steps[max(0, hi - 16):hi]
        running = {e.request_id for s in steps[hi:] for e in s.entries} | set(still)
        for _ in range(rng.randint(1, 2)):
            h.fold(snap_of(ring, running))
        k = hi
    got = h.series()
    assert sum(b.steps for b in got) == len(steps), f"seed {seed}"
    assert sum(b.prefill_tokens for b in got) == sum(s.num_prefill_tokens for s in steps)
    assert sum(b.decode_tokens for b in got) == sum(s.num_decode_tokens for s in steps)
    now = steps[-1].wall_time
    for b in got:       # fine buckets only for the last FINE_S seconds
        assert b.width == (1.0 if b.t >= now - FINE_S - 1 else COARSE) or b.width == COARSE


def test_a_burst_prefill_still_counts_after_it_left_the_ring():
    from views.engine_view import stats_line
    burst = [step(i, 100.0 + 0.01 * i, [StepEntry(f"b-{i}", "prefill", 64, 0)])
             for i in range(16)]
    decode = [step(16 + i, 100.2 + 0.01 * i, [StepEntry("b-0", "decode", 1, 64)])
              for i in range(80)]
    h = EngineTimeline()
    h.fold(snap_of(burst, ["b-0"]))
    ring = decode[-64:]                         # the burst's steps are gone from the ring
    h.fold(snap_of(ring, ["b-0"]))
    snap = SimpleNamespace(steps=ring, running=["b-0"], waiting=[], preemptions=0)
    line = stats_line(snap, now=101.0, history=h)
    pre = 16 * 64 / ((16 + 64) * 0.01)         # the steps folded: burst + the ring
    assert f"**{pre:.0f}** prefill tok/s" in line, line


def test_cpu_engine_tab_shows_the_batch_not_an_all_eager_graph_panel():
    from views.engine_view import graphs_figure
    snap = make_snapshot(np.random.default_rng())
    snap.device = "cpu"
    spec = graphs_figure(snap)
    assert "CPU" in spec["title"] and "no CUDA graphs" in spec["title"]
    names = [se["name"] for p in spec["panels"] for se in p.get("series", []) + p.get("lines", [])]
    assert names and not any("eager" in n for n in names)
    snap.device = "cuda:0"
    assert "CUDA graphs" in graphs_figure(snap)["title"]


def test_timeline_sends_whole_request_ids():
    """Request ids reach the page whole (the canvas fits its margin to the longest; the fit
    test in tests/test_browser_fit.py checks none is shortened on the screen)."""
    from views.figures_engine import batch_timeline_figure
    rid = "chatcmpl-5df0d9a8c1e2-5"
    steps = [step(i, 10.0 + i, [StepEntry(rid, "decode", 1, i)]) for i in range(4)]
    spec = batch_timeline_figure(steps)
    assert spec["panels"][1]["rows"] == [rid]


def _lab(hex_colour):
    rgb = np.array([int(hex_colour[i:i + 2], 16) for i in (1, 3, 5)]) / 255
    lin = np.where(rgb <= 0.04045, rgb / 12.92, ((rgb + 0.055) / 1.055) ** 2.4)
    xyz = np.array([[0.4124, 0.3576, 0.1805], [0.2126, 0.7152, 0.0722],
                    [0.0193, 0.1192, 0.9505]]) @ lin / np.array([0.95047, 1.0, 1.08883])
    f = np.where(xyz > 216 / 24389, np.cbrt(xyz), (24389 / 27 * xyz + 16) / 116)
    return np.array([116 * f[1] - 16, 500 * (f[0] - f[1]), 200 * (f[1] - f[2])])


def test_palette_tells_32_requests_apart_and_from_the_greys():
    ids = [f"chat-{i}" for i in range(32)]
    colours = [request_colour(r) for r in ids]
    assert len(set(colours)) == 32
    labs = [_lab(c) for c in colours]
    closest = min(np.linalg.norm(a - b) for i, a in enumerate(labs) for b in labs[i + 1:])
    assert closest >= 20, f"two request colours only ΔE {closest:.1f} apart"
    for grey in (FREE_COLOUR, EVICTABLE_COLOUR):
        assert min(np.linalg.norm(_lab(grey) - l) for l in labs) >= 20
    assert len(PALETTE) >= 32


def test_one_byte_convention_in_the_kv_tab_and_anatomy():
    from views.figures_anatomy import fmt_bytes as anatomy_bytes
    from views.figures_kv import kv_layout_markdown
    snap = make_snapshot(np.random.default_rng())
    total = 32 * 2 ** 20 + 123
    lay = snap.kv_layout.__class__(snap.kv_layout.shape, "float32", 1 << 14, 1 << 10, total)
    md = kv_layout_markdown(lay, 16)
    assert anatomy_bytes(total) == fmt_bytes(total) == "32.0 MiB" and "32.0 MiB" in md
    assert fmt_bytes(512) == "512 B" and fmt_bytes(141e9) == "131.3 GiB"


def test_layers_follow_this_pages_reply_and_server_wide_is_one_choice():
    from views.layers import AUTO, SERVER, request_choices, resolve_request, slider_max
    traced = ["api-9", "chat-3", "chat-1"]              # newest first
    assert resolve_request(AUTO, None, traced) is None   # a new page: not someone else's
    assert resolve_request(AUTO, "chat-1", traced) == "chat-1"
    assert resolve_request(SERVER, "chat-1", traced) == "api-9"
    assert resolve_request("chat-3", None, traced) == "chat-3"
    labels = dict((v, k) for k, v in request_choices(traced, {"chat-1"}, set()))
    assert "server-wide" in labels[SERVER] and "API" in labels[SERVER]
    for t in range(1, 300):
        assert slider_max(t, True) == max(t - 1, 1)
        assert t - 1 <= slider_max(t, False) <= t + 7


def test_norm_weights_are_named_in_the_weights_bars_note():
    from test_figures_anatomy import make_anatomy
    from views import figures_anatomy as FA
    a = make_anatomy("qwen3")
    fig = FA.weights_figure(a.weights)
    total = a.weights.total_params * a.weights.elem_bytes
    thin = [p for p in a.weights.parts if p.params and p.params * a.weights.elem_bytes
            < FA.MIN_VISIBLE * total]
    assert thin, "the tiny model has norms far under the visible share"
    (note,) = fig["layout"]["annotations"]        # one note under the bar, no arrows
    assert not note["showarrow"]
    for p in thin:
        assert p.label in note["text"]
        assert fmt_bytes(p.params * a.weights.elem_bytes) in note["text"]
    assert sum(t["x"][0] for t in fig["data"]) == a.weights.total_bytes    # widths exact


def test_byte_tokens_show_their_bytes_not_replacement_characters():
    from transformers import AutoTokenizer
    from ui_helpers import ROOT
    from views.token_text import readable
    tok = AutoTokenizer.from_pretrained(str(ROOT / "assets" / "demo-qwen3"))
    text = "héllo → 日本"
    ids = tok.encode(text, add_special_tokens=False)
    shown = [readable(tok, i, tok.decode([i])) for i in ids]
    assert not any("\ufffd" in s for s in shown), shown
    raw = b"".join(bytes(int(h, 16) for h in re.findall(r"<0x([0-9A-F]{2})>", s)) if "<0x" in s
                   else s.encode() for s in shown)
    assert raw.decode() == text


def test_a_shared_server_offers_no_server_wide_layers_view():
    # --api-key or a host beyond this machine, without --public-traces: a page picks among
    # its own replies only (issue 29: traces private by default)
    from views.layers import SERVER, request_choices
    open_ = request_choices(["r2", "r1"], {"r1"}, set())
    shared = request_choices(["r1"], {"r1"}, set(), server_wide=False)
    assert SERVER in [v for _, v in open_] and SERVER not in [v for _, v in shared]
    assert [v for _, v in shared][1:] == ["r1"]
