"""Probe overhead: throughput and batch-1 latency with probes off vs on for one watched request,
as % slowdown. Off and on runs alternate on one engine, so drift hits both equally."""
from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (base_parser, bench_setup, build_engine, error_row, finish_cli,
                          free_memory, log, make_workload, measure_floors, median, row,
                          shutdown_engine)
from bench.latency import FULL, TINY, glassbox_latency
from bench.throughput import run_glassbox, warmup_glassbox, workload_kwargs

BENCH = "probes"


def probe_specs() -> dict[str, object]:
    """Name -> ProbeSpec. Every flag is explicit: ProbeSpec's defaults switch everything on."""
    from engine import ProbeSpec
    return {
        "norms+routing": ProbeSpec(norms=True, logit_lens=False, attention=False, routing=True),
        "attention": ProbeSpec(norms=False, logit_lens=False, attention=True, routing=False),
        "all": ProbeSpec(norms=True, logit_lens=True, attention=True, routing=True),
    }


def throughput_overhead(llm, model: str, num_requests: int, repeats: int, tiny: bool,
                        device, spec) -> tuple[float, float]:
    """Median tok/s (off, on), request 0 of the batch watched when on."""
    kw = workload_kwargs(model, tiny)
    warm = make_workload(4, seed=0, id_stream=9998, **kw)
    for r in warm:
        r.max_tokens = min(r.max_tokens, 8)
    run_glassbox(llm, warm, device, watch=[spec] + [None] * 3)  # probe buffers/graphs, untimed
    off, on = [], []
    for r in range(repeats):
        for watched, samples in ((False, off), (True, on)):
            reqs = make_workload(num_requests, seed=0, id_stream=100 + 2 * r + watched, **kw)
            watch = [spec] + [None] * (len(reqs) - 1) if watched else None
            tok_s, _, _ = run_glassbox(llm, reqs, device, watch=watch)
            samples.append(tok_s)
        log(f"probes throughput repeat {r}: off {off[-1]:,.0f} tok/s, on {on[-1]:,.0f} tok/s")
    return median(off), median(on)


def latency_overhead(llm, device, id_high: int, shape: dict, repeats: int,
                     specs: dict[str, object]) -> dict[str, tuple[float, float]]:
    """Median (ms/token, TTFT ms) per probe config, the batch-1 request watched."""
    configs = {"off": None, **specs}
    ms: dict[str, list[float]] = {k: [] for k in configs}
    ttft: dict[str, list[float]] = {k: [] for k in configs}
    for r in range(repeats):
        for i, (name, spec) in enumerate(configs.items()):
            res = glassbox_latency(llm, device, id_high, repeats=1, ttft_repeats=1, watch=spec,
                                   stream0=10_000 + 1000 * r + 100 * i, warmup=r == 0,
                                   **shape)
            ms[name].append(res["ms_per_token"])
            ttft[name].append(res["ttft_ms"])
        log(f"probes latency repeat {r}: " +
            ", ".join(f"{k} {v[-1]:.3f} ms/tok" for k, v in ms.items()))
    return {k: (median(ms[k]), median(ttft[k])) for k in configs}


def _throughput_rows(llm, model: str, num_requests: int, repeats: int, tiny: bool, dev,
                     spec) -> list[dict]:
    try:
        off, on = throughput_overhead(llm, model, num_requests, repeats, tiny, dev, spec)
    except Exception as exc:
        return [error_row(BENCH, model, "glassbox", exc)]
    note = f"{num_requests} req, request 0 watched, median of {repeats}"
    return [row(BENCH, model, "glassbox", "output_tok_s[off]", off, "tok/s", note),
            row(BENCH, model, "glassbox", "output_tok_s[norms+routing]", on, "tok/s", note),
            row(BENCH, model, "glassbox", "throughput_slowdown_pct[norms+routing]",
                _pct(off, on), "%", note)]


def _pct(slow: float, fast: float) -> float:
    return 100.0 * (slow / fast - 1.0)


def main(model: str = "qwen3-0.6b", device: str | None = None, dtype=None,
         num_requests: int = 64, tput_repeats: int = 3, lat_repeats: int = 3, tiny: bool = False,
         floors: bool = True, engine_kwargs: dict | None = None, llm=None) -> list[dict]:
    """`llm`: an engine already built for this model (run_all shares one); else one is built."""
    model, dev, dtype = bench_setup(model, device, dtype, tiny)
    shape = dict(TINY if tiny else FULL)
    id_high = workload_kwargs(model, tiny)["id_high"]
    rows: list[dict] = measure_floors(dev) if floors else []
    own = llm is None
    try:
        specs = probe_specs()
        if own:
            llm = build_engine(model, dev, dtype, max_model_len=4096 if not tiny else 256,
                               **(engine_kwargs or {}))
        warmup_glassbox(llm, model, tiny, dev)
        if num_requests > 0:
            rows += _throughput_rows(llm, model, num_requests, tput_repeats, tiny, dev,
                                     specs["norms+routing"])
        lat = latency_overhead(llm, dev, id_high, shape, lat_repeats, specs)
        base_ms, base_ttft = lat.pop("off")
        note = f"batch 1, {shape['new_tokens']} new tok, median of {lat_repeats}"
        rows.append(row(BENCH, model, "glassbox", "ms_per_token[off]", base_ms, "ms", note))
        for name, (ms, t) in lat.items():
            rows += [row(BENCH, model, "glassbox", f"ms_per_token[{name}]", ms, "ms", note),
                     row(BENCH, model, "glassbox", f"decode_slowdown_pct[{name}]",
                         _pct(ms, base_ms), "%", note),
                     row(BENCH, model, "glassbox", f"ttft_slowdown_pct[{name}]",
                         _pct(t, base_ttft), "%", f"{shape['ttft_prompt_len']}-tok prompt")]
    except Exception as exc:
        rows.append(error_row(BENCH, model, "glassbox", exc))
    finally:
        if own:
            shutdown_engine(llm)
        llm = None
        free_memory(dev)
    return rows


def cli(argv=None) -> list[dict]:
    p = base_parser(__doc__)
    p.add_argument("--num-requests", type=int, default=64,
                   help="the throughput half's size (0: skip it)")
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args(argv)
    if a.tiny:
        a.num_requests, a.repeats = min(a.num_requests, 4), 1
    rows = main(a.model, a.device, a.dtype, a.num_requests, a.repeats, a.repeats, a.tiny,
                not a.no_floors)
    finish_cli(rows, "probes", a.json)
    return rows


if __name__ == "__main__":
    cli()
