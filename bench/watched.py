"""Watched: the engine's speed with the playground open beside it, vs with nobody looking.

Three pollers stand for three open pages, one per live tab, each at the live cadence
(views/live.py's TICK_BUSY_S) and through the same serving hub the app uses (one shared
snapshot per SNAPSHOT_MAX_AGE_S):
  - KV tab:      hub.snapshot() -> the block map's JSON, the block tables, the usage plot
  - Layers tab:  llm.traced_requests() + llm.trace(watched) -> norms, logit lens, attention
                 heads and row charts (and routing on an MoE model)
  - Engine tab:  hub.snapshot() -> batch timeline, step-time split and CUDA-graph plots
Batch-1 decode and the `throughput` workload run with the pollers off and on, alternating on one
engine (the same request watched in both, so only looking differs). Reported: % slowdown,
how long inspect() / trace() held the engine lock (p50 / p99 / max), and how long each tab
took to build its data (p50 / p99), and for each timed run the Triton compiles and CUDA graph
captures that happened inside it (a first run slower than the rest is one of these, or neither).
"""
from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

from bench.common import (base_parser, bench_setup, build_engine, error_row, finish_cli,
                          free_memory, log, make_workload, measure_floors, median, random_prompt,
                          row, sampling, shutdown_engine)
from bench.latency import FULL, TINY
from bench.throughput import warmup_glassbox, workload_kwargs

BENCH = "watched"
TICK_S = 0.2            # views/live.py TICK_BUSY_S: a live tab's cadence while requests run
TABS = ("kv", "layers", "engine")


class Page(threading.Thread):
    """One open page showing one live tab: a tick every TICK_S, like a Gradio timer."""

    def __init__(self, tab: str, hub, watched: list):
        super().__init__(name=f"watch-{tab}", daemon=True)
        self.tab, self.hub, self.watched = tab, hub, watched
        self.stop = threading.Event()
        self.build_s: list[float] = []
        self.work_s: list[float] = []       # the tick's own CPU time (wall less GIL waits)
        self.errors: list[str] = []
        self.last_usage = 0.0
        self.parts: dict[str, list[tuple[float, float]]] = {}   # tick part -> (cpu, wall) ms

    def run(self) -> None:
        while True:                     # a tab opened refreshes at once, then on its timer
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                getattr(self, f"tick_{self.tab}")()
            except Exception as e:      # noqa: BLE001 — reported, never kills the bench
                self.errors.append(repr(e))

            self.build_s.append(time.perf_counter() - t0)
            self.work_s.append(time.thread_time() - c0)
            if self.stop.wait(TICK_S):
                return

    def _lap(self):
        """A timer of the tick's parts: CPU (thread) and wall ms per part, kept per page."""
        last = [time.thread_time(), time.perf_counter()]

        def lap(name: str) -> None:
            c, w = time.thread_time(), time.perf_counter()
            self.parts.setdefault(name, []).append(((c - last[0]) * 1e3, (w - last[1]) * 1e3))
            last[:] = [c, w]
        return lap

    def tick_kv(self) -> None:
        from views import figures as F
        from views.live_plot import plot_value
        lap = self._lap()
        snap = self.hub.snapshot()
        lap("snapshot")
        data = F.kv_map_data(snap, 0)
        lap("map data")
        F.kv_map_json(data)
        lap("map json")
        F.block_tables_html(snap)
        lap("tables")
        now = time.time()
        if now - self.last_usage >= 1.0:            # the usage plot: once a second
            plot_value(F.kv_usage_figure(snap, list(self.hub.hit_history), now))
            self.last_usage = now
            lap("usage plot")

    def tick_layers(self) -> None:
        from views import figures as F
        from views.canvas_chart import chart_value
        snap = self.hub.snapshot()
        llm = self.hub.llm
        traced = llm.traced_requests()
        rid = self.watched[0] if self.watched and self.watched[0] in traced else (
            traced[0] if traced else None)
        if rid is None:
            return
        lap = self._lap()
        tr = llm.trace(rid)
        lap("trace")
        t = len(tr.resid_norms)
        if not t:
            return
        tok = t - 1
        chart_value(F.norms_figure(tr, tok))
        lap("norms")
        chart_value(F.logit_lens_figure(tr, self.hub.decode, tok))
        lap("lens")
        step = F.attention_step_for(tr, tok)
        if step is not None:
            layer = tr.num_layers - 1
            step.layer_probs(step.layers.index(layer))
            lap("attention row to host")
            chart_value(F.attention_heads_figure(step, layer, tr.token_texts, 0, rid))
            chart_value(F.attention_row_figure(step, layer, 0, tr.token_texts, rid))
            lap("heads + row charts")
        if snap.moe is not None and tr.router_probs:
            chart_value(F.routing_figure(tr, tok, snap.moe["num_experts"]))

    def tick_engine(self) -> None:
        from views import figures as F
        from views.figures_engine import graphs_figure, step_stats
        from views.step_chart import board_value
        lap = self._lap()
        snap = self.hub.snapshot()
        lap("snapshot")
        step_stats(snap.steps)
        parts = {"timeline": F.batch_timeline_figure(snap.steps),      # the tab's one value
                 "steptime": F.step_time_figure(snap.steps), "graphs": graphs_figure(snap)}
        lap("builders")
        board_value(parts)
        lap("json")


class Watchers:
    """The three pages, started and stopped around one measured run."""

    def __init__(self, hub, watched: list):
        self.hub, self.watched = hub, watched
        self.pages: list[Page] = []
        self.builds: dict[str, list[float]] = {t: [] for t in TABS}
        self.works: dict[str, list[float]] = {t: [] for t in TABS}
        self.errors: list[str] = []
        self.parts: dict[str, list] = {}

    def absorb(self, other: "Watchers") -> None:
        """Add another run's tick times and errors to these (one summary over all runs)."""
        for t in TABS:
            self.builds[t] += other.builds[t]
            self.works[t] += other.works[t]
        for k, v in other.parts.items():
            self.parts.setdefault(k, []).extend(v)
        self.errors += other.errors

    def __enter__(self):
        self.pages = [Page(t, self.hub, self.watched) for t in TABS]
        for p in self.pages:
            p.start()
        return self

    def __exit__(self, *exc):
        for p in self.pages:
            p.stop.set()
        for p in self.pages:
            p.join()
            self.builds[p.tab] += p.build_s
            self.works[p.tab] += p.work_s
            self.errors += p.errors
            for k, v in p.parts.items():
                self.parts.setdefault(f"{p.tab}: {k}", []).extend(v)


def _pct(slow: float, fast: float) -> float:
    return 100.0 * (slow / fast - 1.0)


class _GcLog:
    """Every garbage collection of the run (start, end, generation), through gc.callbacks."""

    def __init__(self):
        import gc
        self.runs, self._start = [], {}
        self._cb = self._on
        gc.callbacks.append(self._cb)

    def _on(self, phase, info):
        t, key = time.perf_counter(), threading.get_ident()
        if phase == "start":
            self._start[key] = t
        elif key in self._start:
            self.runs.append((self._start.pop(key), t, info.get("generation")))

    def stop(self) -> None:
        import gc
        if self._cb in gc.callbacks:
            gc.callbacks.remove(self._cb)

    def _overlaps(self, t0, wall):
        return [g for a, b, g in self.runs if a < t0 + wall and b > t0]

    def inside(self, starts, walls) -> list[bool]:
        return [bool(self._overlaps(t0, w)) for t0, w in zip(starts, walls)]

    def gens_inside(self, starts, walls) -> str:
        from collections import Counter
        c = Counter(g for t0, w in zip(starts, walls) for g in self._overlaps(t0, w))
        return ", ".join(f"{g}: {n}" for g, n in sorted(c.items())) or "none"


def _stats_ms(xs) -> tuple[float, float, float]:
    a = np.asarray(list(xs), dtype=float) * 1e3
    if not len(a):
        return float("nan"), float("nan"), float("nan")
    return float(np.percentile(a, 50)), float(np.percentile(a, 99)), float(a.max())


def graphs_held(llm) -> int:
    """CUDA graphs the engine holds (decode + prefill buckets, every variant); 0 eager or under
    tensor parallelism (the driver keeps them on its workers)."""
    runner = getattr(llm, "runner", None)
    return sum(len(getattr(g, "graphs", None) or {}) for g in
               (getattr(runner, "graphs", None), getattr(runner, "prefill_graphs", None)))


class RunLedger:
    """What happened inside each timed run besides the work: Triton compiles (names, seconds)
    and CUDA graphs captured. A first run slower than the later ones (17.5k vs 21.8k tok/s on
    2026-12-03) is one of these or neither; these rows say which."""

    def __init__(self, llm):
        from bench.common import CompileLog
        self.llm, self.compiles = llm, CompileLog()
        self.rows: list[tuple[str, int, float, int, str]] = []

    def run(self, label: str, fn):
        n0, g0 = len(self.compiles.entries), graphs_held(self.llm)
        out = fn()
        new = self.compiles.entries[n0:]
        names = ", ".join(sorted({n for n, _ in new}))
        self.rows.append((label, len(new), sum(t for _, t in new),
                          graphs_held(self.llm) - g0, names))
        return out

    def close(self) -> None:
        self.compiles.close()

    def as_rows(self, model: str) -> list[dict]:
        out = []
        for label, n, secs, graphs, names in self.rows:
            note = f"{secs:.2f} s compiling{': ' + names if names else ''}"
            out += [row(BENCH, model, "glassbox", f"triton_compiles[{label}]", n, "", note),
                    row(BENCH, model, "glassbox", f"graphs_captured[{label}]", graphs, "",
                        "decode + prefill CUDA graphs new during the run")]
        return out


def watched_spec():
    """What a watched API request records (`"glassbox": {"watch": true}`): every probe."""
    from engine import ProbeSpec
    return ProbeSpec()


def latency_runs(llm, hub, shape: dict, id_high: int, repeats: int, ledger: RunLedger | None = None
                 ) -> tuple[list, list, Watchers]:
    """Batch-1 decode ms/token, pollers off then on, `repeats` times; the request is watched
    in both (a chat reply is), so only the looking differs."""
    spec = watched_spec()
    off, on = [], []
    watched: list = []
    w_all = Watchers(hub, watched)
    for r in range(repeats):
        order = ((False, off), (True, on)) if r % 2 == 0 else ((True, on), (False, off))
        for looking, samples in order:     # alternating which goes first
            prompt = random_prompt(shape["prompt_len"], id_high, 40_000 + 10 * r + looking)
            rid = f"watched-lat-{r}-{int(looking)}"
            watched[:] = [rid]
            label = f"batch 1 {'on' if looking else 'off'}, repeat {r}"

            def one():
                return _decode_ms(llm, prompt, shape["new_tokens"], spec, rid)
            if looking:
                with Watchers(hub, watched) as w:
                    samples.append(_in(ledger, label, one))
                w_all.absorb(w)
            else:
                samples.append(_in(ledger, label, one))
        log(f"watched latency repeat {r}: off {off[-1]:.3f} ms/tok, on {on[-1]:.3f} ms/tok")
    return off, on, w_all


def _in(ledger: RunLedger | None, label: str, fn):
    return fn() if ledger is None else ledger.run(label, fn)


def _decode_ms(llm, prompt, new_tokens: int, spec, rid: str) -> float:
    times = []
    for ev in llm.stream(prompt, sampling(temperature=0.0, ignore_eos=True,
                                          max_tokens=new_tokens), watch=spec, request_id=rid):
        if ev.token_id is not None:
            times.append(time.perf_counter())
    return 1e3 * (times[-1] - times[0]) / (len(times) - 1)


def throughput_runs(llm, hub, model: str, num_requests: int, repeats: int, tiny: bool,
                    ledger: RunLedger | None = None) -> tuple[list, list, Watchers]:
    """Output tok/s of the workload, pollers off then on; request 0 watched in both."""
    kw = workload_kwargs(model, tiny)
    spec = watched_spec()
    off, on = [], []
    watched: list = []
    w_all = Watchers(hub, watched)
    # untimed, the workload's prompts: the prefill graphs of its buckets and the decode graphs
    # with the watched request's probes are captured the first time a step needs one, and the
    # first timed run used to pay for them (the first "off" run read 14-18k against 22k).
    # Request 0 (watched) lives longest and the others end about two a step apart, so once
    # every prompt is in (a step or ~20 for the full workload) the decode batch drains through
    # every bucket with the watched request in it, as a timed run's tail does
    warm = make_workload(num_requests, seed=0, id_stream=299, **kw)
    n, base = len(warm), 2 if tiny else 32
    llm.generate([q.prompt for q in warm],
                 [sampling(temperature=0.6, ignore_eos=True, max_tokens=base + (n - i) // 2)
                  for i in range(n)], watch=[spec] + [None] * (n - 1))
    for r in range(repeats):
        order = ((False, off), (True, on)) if r % 2 == 0 else ((True, on), (False, off))
        for looking, samples in order:     # alternating which goes first
            reqs = make_workload(num_requests, seed=0, id_stream=300 + 2 * r + looking, **kw)
            params = [sampling(temperature=0.6, ignore_eos=True, max_tokens=q.max_tokens)
                      for q in reqs]
            watch = [spec] + [None] * (len(reqs) - 1)

            def run():
                t0 = time.perf_counter()
                # the first request's id is known before it runs: stream it, generate the rest
                outs = llm.generate([q.prompt for q in reqs], params, watch=watch)
                return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0)
            label = f"throughput {'on' if looking else 'off'}, repeat {r}"
            if looking:
                watched[:] = []                 # the pages follow the newest traced request
                with Watchers(hub, watched) as w:
                    samples.append(_in(ledger, label, run))
                w_all.absorb(w)
            else:
                samples.append(_in(ledger, label, run))
        log(f"watched throughput repeat {r}: off {off[-1]:,.0f} tok/s, on {on[-1]:,.0f} tok/s")
    return off, on, w_all


def main(model: str = "qwen3-0.6b", device: str | None = None, dtype=None,
         num_requests: int = 256, tput_repeats: int = 2, lat_repeats: int = 3,
         tiny: bool = False, floors: bool = True, llm=None) -> list[dict]:
    """`llm`: an engine already built for this model (run_all shares one); else one is built."""
    from engine.serving import ServingHub
    model, dev, dtype = bench_setup(model, device, dtype, tiny)
    shape = dict(TINY if tiny else FULL)
    id_high = workload_kwargs(model, tiny)["id_high"]
    rows: list[dict] = measure_floors(dev) if floors else []
    own = llm is None
    gc_log = ledger = None
    try:
        if own:
            llm = build_engine(model, dev, dtype, max_model_len=4096 if not tiny else 256)
        warmup_glassbox(llm, model, tiny, dev)
        hub = ServingHub(llm)
        warm = Page("kv", hub, [])              # imports and first builds, outside the timings
        llm.generate([random_prompt(shape["prompt_len"], id_high, 39_999)],
                     sampling(temperature=0.0, max_tokens=2), watch=watched_spec())
        for tab in TABS:
            getattr(warm, f"tick_{tab}")()
        blocks = f"{llm.num_kv_blocks} KV blocks"
        for name in ("inspect", "trace"):
            llm.inspector.lock_hold_s[name].clear()
            llm.inspector.lock_hold_cpu_s[name].clear()
        hand = llm.inspector.snapshots
        hand.copy_s.clear()
        hand.copy_cpu_s.clear()
        hand.copy_at.clear()
        served0, fall0, reused0 = hand.served, hand.fallbacks, hand.reused
        gc_log = _GcLog()           # which engine copies a garbage collection ran inside
        ledger = RunLedger(llm)
        off, on, w_lat = latency_runs(llm, hub, shape, id_high, lat_repeats, ledger)
        note = f"batch 1, {shape['new_tokens']} tok, watched both, median of {lat_repeats}, {blocks}"
        rows += [row(BENCH, model, "glassbox", "ms_per_token[nobody watching]", median(off),
                     "ms", note),
                 row(BENCH, model, "glassbox", "ms_per_token[KV+Layers+Engine tabs]", median(on),
                     "ms", note),
                 row(BENCH, model, "glassbox", "decode_slowdown_pct", _pct(median(on),
                                                                         median(off)), "%", note)]
        t_off, t_on, w_tput = throughput_runs(llm, hub, model, num_requests, tput_repeats, tiny,
                                              ledger)
        rows += ledger.as_rows(model)
        note = f"{num_requests} req, request 0 watched both, median of {tput_repeats}, {blocks}"
        rows += [row(BENCH, model, "glassbox", "output_tok_s[nobody watching]", median(t_off),
                     "tok/s", note),
                 row(BENCH, model, "glassbox", "output_tok_s[KV+Layers+Engine tabs]",
                     median(t_on), "tok/s", note),
                 row(BENCH, model, "glassbox", "throughput_slowdown_pct",
                     _pct(median(t_off), median(t_on)), "%", note)]
        for name in ("inspect", "trace"):
            p50, p99, mx = _stats_ms(llm.inspector.lock_hold_s[name])
            n = len(llm.inspector.lock_hold_s[name])
            note = f"{n} calls while the pages polled, {blocks}"
            rows += [row(BENCH, model, "glassbox", f"{name}_lock_hold_p50", p50, "ms", note),
                     row(BENCH, model, "glassbox", f"{name}_lock_hold_p99", p99, "ms", note),
                     row(BENCH, model, "glassbox", f"{name}_lock_hold_max", mx, "ms", note)]
            p50, p99, mx = _stats_ms(llm.inspector.lock_hold_cpu_s[name])
            note = "the reader's CPU time under the lock (wall less OS/GIL waits)"
            rows += [row(BENCH, model, "glassbox", f"{name}_lock_work_p99", p99, "ms", note),
                     row(BENCH, model, "glassbox", f"{name}_lock_work_max", mx, "ms", note)]
        # inspect() while the engine is busy: the engine thread copies at a step boundary (no
        # reader holds the lock); the reader copies under the lock only when the engine idles
        # or a step runs past the handoff's wait (counted above as inspect_lock_hold)
        served, fell = hand.served - served0, hand.fallbacks - fall0
        note = (f"{served} snapshots copied by the engine thread at a step boundary, "
                f"{fell} by the reader under the lock, {hand.reused - reused0} reused lock-free "
                f"(an idle engine, unchanged since the last copy), {blocks}")
        p50, p99, mx = _stats_ms(hand.copy_s)
        rows += [row(BENCH, model, "glassbox", "inspect_engine_copy_p50", p50, "ms", note),
                 row(BENCH, model, "glassbox", "inspect_engine_copy_p99", p99, "ms", note),
                 row(BENCH, model, "glassbox", "inspect_engine_copy_max", mx, "ms", note)]
        p50, p99, mx = _stats_ms(hand.copy_cpu_s)
        rows += [row(BENCH, model, "glassbox", "inspect_engine_copy_cpu_p99", p99, "ms",
                     "the engine thread's CPU time per copy")]
        gc_log.stop()
        hit = gc_log.inside(hand.copy_at, hand.copy_s)
        clean = [w for w, h in zip(hand.copy_s, hit) if not h]
        p50c, p99c, _ = _stats_ms(clean)
        rows.append(row(BENCH, model, "glassbox", "inspect_engine_copy_p99[no gc inside]", p99c,
                        "ms", f"{sum(hit)} of {len(hit)} copies had a garbage collection "
                        f"(gens {gc_log.gens_inside(hand.copy_at, hand.copy_s)}) inside"))
        rows.append(row(BENCH, model, "glassbox", "inspect_handed_over_pct",
                        100.0 * served / max(1, served + fell), "%", note))
        import sys as _sys
        rows.append(row(BENCH, model, "glassbox", "gil_switch_interval", 1e3 *
                        _sys.getswitchinterval(), "ms", "sys.getswitchinterval() in this run"))
        for tab in TABS:           # beside batch-1 decode alone: the figure that matters there
            p50, p99, _ = _stats_ms(w_lat.works[tab])
            note = f"{len(w_lat.works[tab])} ticks beside batch-1 decode"
            rows += [row(BENCH, model, "glassbox", f"tab_work_p50[{tab}, batch 1]", p50, "ms",
                         note),
                     row(BENCH, model, "glassbox", f"tab_work_p99[{tab}, batch 1]", p99, "ms",
                         note)]
        for tab in TABS:
            builds = w_lat.builds[tab] + w_tput.builds[tab]
            p50, p99, mx = _stats_ms(builds)
            note = f"{len(builds)} ticks (snapshot/trace + the views' builders)"
            rows += [row(BENCH, model, "glassbox", f"tab_build_p50[{tab}]", p50, "ms", note),
                     row(BENCH, model, "glassbox", f"tab_build_p99[{tab}]", p99, "ms", note)]
            works = w_lat.works[tab] + w_tput.works[tab]
            p50, p99, mx = _stats_ms(works)
            note = "the tick's CPU time: what it takes from the engine's share of the GIL"
            rows += [row(BENCH, model, "glassbox", f"tab_work_p50[{tab}]", p50, "ms", note),
                     row(BENCH, model, "glassbox", f"tab_work_p99[{tab}]", p99, "ms", note)]
        for where, w in (("batch 1", w_lat), ("throughput", w_tput)):   # where a tick's time goes
            for part, xs in w.parts.items():
                a = np.asarray(xs)
                rows.append(row(BENCH, model, "glassbox", f"tick_part_cpu_p50[{part}, {where}]",
                                float(np.median(a[:, 0])), "ms",
                                f"wall p50 {np.median(a[:, 1]):.2f} ms, {len(a)} ticks"))
        errors = w_lat.errors + w_tput.errors
        if errors:
            rows.append(row(BENCH, model, "glassbox", "poller_errors", len(errors), "",
                            errors[0][:200]))
    except Exception as exc:
        rows.append(error_row(BENCH, model, "glassbox", exc))
    finally:
        if gc_log is not None:
            gc_log.stop()           # idempotent: also after an error mid-run
        if ledger is not None:
            ledger.close()
        if own:
            shutdown_engine(llm)
        llm = None
        free_memory(dev)
    return rows


def cli(argv=None) -> list[dict]:
    p = base_parser(__doc__)
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--repeats", type=int, default=2)
    a = p.parse_args(argv)
    if a.tiny:
        a.num_requests, a.repeats = min(a.num_requests, 8), 1
    rows = main(a.model, a.device, a.dtype, a.num_requests, a.repeats, max(a.repeats, 1),
                a.tiny, not a.no_floors)
    finish_cli(rows, "watched", a.json)
    return rows


if __name__ == "__main__":
    cli()
