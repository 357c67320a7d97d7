"""Intervention cost: batch-1 decode (ms/token) and `throughput` with no intervention vs one
request carrying each kind (ablate heads, mask experts on MoE shapes, steer), alternating on one
engine so drift hits every configuration alike. Targets (BENCH.md): requests without any
intervention <= 1 % slower than before this feature (compare `ms_per_token[none]` /
`output_tok_s[none]` with bench/latency.py and bench/throughput.py on the parent commit, same
GPU), an intervened batch-1 request <= 10 % slower than an untouched one.

    python bench/diagnostics/interventions.py --model qwen3-0.6b          # H200; --tiny: a CPU smoke run
    python bench/diagnostics/interventions.py --model qwen3-30b-a3b
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common import (base_parser, bench_setup, build_engine, error_row, finish_cli,
                          free_memory, log, make_workload, measure_floors, median, random_prompt,
                          row, sampling, shutdown_engine, timed)
from bench.latency import FULL, TINY
from bench.throughput import warmup_glassbox, workload_kwargs

BENCH = "interventions"


def configs(llm) -> dict[str, list | None]:
    """Name -> interventions of the measured request. One layer in the middle of the model;
    'steer' adds a random vector of norm ~ the residual's; 'all layers' ablates a head in every
    layer (the worst case: an edit at each layer of the graph)."""
    import torch

    from engine import Intervention
    f = llm.intervention_facts
    mid = f.num_layers // 2
    v = torch.randn(f.hidden_size, generator=torch.Generator().manual_seed(0))
    out: dict[str, list | None] = {
        "none": None,
        "ablate_heads": [Intervention.ablate_heads(mid, [0, 1])],
        "steer": [Intervention.steer(mid, v, 4.0)],
        "ablate_heads[all layers]": [Intervention.ablate_heads(layer, [0])
                                     for layer in range(f.num_layers)],
    }
    if f.moe_layers:
        out["mask_experts"] = [Intervention.mask_experts(f.moe_layers[len(f.moe_layers) // 2],
                                                         [0, 1])]
    return out


def decode_ms(llm, prompt: list[int], new_tokens: int, ivs) -> float:
    """ms per decoded token inside one streamed request (prefill excluded)."""
    times = []
    for ev in llm.stream(prompt, sampling(temperature=0.0, ignore_eos=True, max_tokens=new_tokens),
                         interventions=ivs):
        if ev.token_id is not None:
            times.append(time.perf_counter())
    return 1e3 * (times[-1] - times[0]) / (len(times) - 1)


def latency(llm, id_high: int, shape: dict, repeats: int, cfgs: dict) -> dict[str, float]:
    ms: dict[str, list[float]] = {k: [] for k in cfgs}
    for name, ivs in cfgs.items():      # warm-up: each variant's decode graph captured once
        decode_ms(llm, random_prompt(shape["prompt_len"], id_high, 7000), 4, ivs)
    for r in range(repeats):
        for i, (name, ivs) in enumerate(cfgs.items()):
            prompt = random_prompt(shape["prompt_len"], id_high, 20_000 + 100 * r + i)
            ms[name].append(decode_ms(llm, prompt, shape["new_tokens"], ivs))
        log(f"interventions latency repeat {r}: " +
            ", ".join(f"{k} {v[-1]:.3f} ms/tok" for k, v in ms.items()))
    return {k: median(v) for k, v in ms.items()}


def throughput(llm, model: str, num_requests: int, repeats: int, tiny: bool, device,
               cfgs: dict) -> dict[str, float]:
    """Median output tok/s of the workload, request 0 intervened (or none)."""
    kw = workload_kwargs(model, tiny)
    tok: dict[str, list[float]] = {k: [] for k in cfgs}
    for r in range(repeats):
        for i, (name, ivs) in enumerate(cfgs.items()):
            reqs = make_workload(num_requests, seed=0, id_stream=300 + 10 * r + i, **kw)
            params = [sampling(temperature=0.6, ignore_eos=True, max_tokens=q.max_tokens)
                      for q in reqs]
            per = [ivs] + [None] * (len(reqs) - 1)
            outs, secs = timed(lambda: llm.generate([q.prompt for q in reqs], params,
                                                    interventions=per), device)
            tok[name].append(sum(len(o.token_ids) for o in outs) / secs)
        log(f"interventions throughput repeat {r}: " +
            ", ".join(f"{k} {v[-1]:,.0f} tok/s" for k, v in tok.items()))
    return {k: median(v) for k, v in tok.items()}


def _pct(slow: float, fast: float) -> float:
    return 100.0 * (slow / fast - 1.0)


def main(model: str = "qwen3-0.6b", device: str | None = None, dtype=None,
         num_requests: int = 256, tput_repeats: int = 3, lat_repeats: int = 5,
         tiny: bool = False, floors: bool = True) -> list[dict]:
    model, dev, dtype = bench_setup(model, device, dtype, tiny)
    shape = dict(TINY if tiny else FULL)
    id_high = workload_kwargs(model, tiny)["id_high"]
    rows: list[dict] = measure_floors(dev) if floors else []
    llm = None
    try:
        llm = build_engine(model, dev, dtype, max_model_len=4096 if not tiny else 256)
        warmup_glassbox(llm, model, tiny, dev)
        cfgs = configs(llm)
        lat = latency(llm, id_high, shape, lat_repeats, cfgs)
        note = f"batch 1, {shape['new_tokens']} new tok, median of {lat_repeats}"
        for name, ms in lat.items():
            rows.append(row(BENCH, model, "glassbox", f"ms_per_token[{name}]", ms, "ms", note))
            if name != "none":
                rows.append(row(BENCH, model, "glassbox", f"decode_slowdown_pct[{name}]",
                                _pct(ms, lat["none"]), "%", note))
        tput_cfgs = {k: v for k, v in cfgs.items() if k != "ablate_heads[all layers]"}
        tput = throughput(llm, model, num_requests, tput_repeats, tiny, dev, tput_cfgs)
        note = f"{num_requests} req, request 0 intervened, median of {tput_repeats}"
        for name, t in tput.items():
            rows.append(row(BENCH, model, "glassbox", f"output_tok_s[{name}]", t, "tok/s", note))
            if name != "none":
                rows.append(row(BENCH, model, "glassbox", f"throughput_slowdown_pct[{name}]",
                                _pct(tput["none"], t), "%", note))
    except Exception as exc:
        rows.append(error_row(BENCH, model, "glassbox", exc))
    finally:
        shutdown_engine(llm)
        free_memory(dev)
    return rows


def cli(argv=None) -> list[dict]:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args(argv)
    if a.tiny:
        a.num_requests, a.repeats = min(a.num_requests, 4), 1
    rows = main(a.model, a.device, a.dtype, a.num_requests, a.repeats, max(a.repeats, 5)
                if not a.tiny else 1, a.tiny, not a.no_floors)
    finish_cli(rows, "interventions", a.json)
    return rows


if __name__ == "__main__":
    cli()
