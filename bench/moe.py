"""Qwen3-30B-A3B shapes: batch-1 latency and throughput, glassbox vs HF (batch-1 generate, and
generate at batch 32 for throughput). Both models are ~60 GB in bf16, so they run one after the
other: ours is built, measured and freed before HF is built.

Throughput runs the dense `throughput` workload (256 requests) and prints beside it the
workload's bandwidth floor (bench/moe_floor.py): the bytes each step of the run had to read at
its batch (experts hit, dense weights, KV cache), summed over the run's step traces, over the
measured copy bandwidth. Distinct experts per step: the uniform-routing expectation from the
step's batch, or with --count-experts counted from the engine's expert load (the figure then
carries that probe's cost)."""
from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (base_parser, bench_setup, build_engine, error_row, finish_cli,
                          free_memory, hf_generate, hf_peer, log, make_workload, measure_floors,
                          ratio_row, row, shutdown_engine, timed)
from bench.latency import FULL, TINY, compare_rows, glassbox_latency, hf_latency, latency_rows
from bench.moe_floor import copy_bandwidth, model_bytes, run_floor
from bench.throughput import run_glassbox, warmup_glassbox, workload_kwargs

BENCH = "moe"
# every step of a run stays in the engine's step history, for the floor (a run has ~2,000 steps)
TRACE_HISTORY = 1 << 16


def throughput_with_floor(llm, model: str, num_requests: int, repeats: int, tiny: bool, device,
                          copy_bw: float, counted: bool) -> list[dict]:
    """Per repeat: output tok/s, and the floor of the steps that repeat ran."""
    mb = model_bytes(llm)
    kw = workload_kwargs(model, tiny)
    out = []
    for r in range(repeats):
        reqs = make_workload(num_requests, seed=0, id_stream=r, **kw)
        _, cursor = llm.steps_since(0)
        tok_s, tokens, secs = run_glassbox(llm, reqs, device)
        steps, end = llm.steps_since(cursor)
        if len(steps) != end - cursor:
            log(f"warning: the step history kept {len(steps)} of the run's {end - cursor} steps; "
                f"the floor covers those only")
        f = run_floor(steps, mb, copy_bw, counted)
        f.update(tok_s=tok_s, tokens=tokens, secs=secs, floor_tok_s=tokens / f["seconds"])
        log(f"glassbox {model} throughput repeat {r}: {tokens} tokens in {secs:.2f}s = {tok_s:,.0f} tok/s; "
            f"floor {f['floor_tok_s']:,.0f} tok/s ({f['seconds']:.2f}s): {100 * tok_s / f['floor_tok_s']:.1f} % "
            f"of the floor")
        out.append(f)
    return out


def floor_rows(model: str, runs: list[dict], num_requests: int, copy_bw: float) -> list[dict]:
    """The median repeat's figure, its floor, and the floor's parts."""
    f = sorted(runs, key=lambda r: r["tok_s"])[len(runs) // 2]
    how = "experts counted from the run's expert load" if f["counted"] else \
        "experts per step E(1-(1-k/E)^B), uniform routing"
    gb = lambda b: f"{b / 1e9:,.1f} GB" if b >= 1e9 else f"{b / 1e6:,.1f} MB"  # noqa: E731
    note = (f"{f['steps']} steps ({f['decode_steps']} decode, mean decode batch {f['mean_decode_batch']:.0f}, "
            f"{f['experts_per_layer']:.1f} experts a layer a step); read {gb(f['expert_bytes'])} experts "
            f"+ {gb(f['dense_bytes'])} dense + {gb(f['kv_bytes'])} KV at {copy_bw / 1e9:,.0f} GB/s; {how}")
    log(f"glassbox {model} throughput {f['tok_s']:,.0f} tok/s vs the workload's floor "
        f"{f['floor_tok_s']:,.0f} tok/s = {100 * f['tok_s'] / f['floor_tok_s']:.1f} %: {note}")
    return [
        row(BENCH, model, "glassbox", "output_tok_s", f["tok_s"], "tok/s",
            f"{num_requests} req, {f['tokens']} out tok, median of {len(runs)}"),
        row(BENCH, model, "floor", "output_tok_s", f["floor_tok_s"], "tok/s", note),
        row(BENCH, model, "glassbox", "output_pct_of_floor", 100 * f["tok_s"] / f["floor_tok_s"], "%",
            "throughput / the workload's bandwidth floor"),
        row(BENCH, model, "floor", "floor_s[experts]", f["expert_bytes"] / copy_bw, "s", gb(f["expert_bytes"])),
        row(BENCH, model, "floor", "floor_s[dense]", f["dense_bytes"] / copy_bw, "s", gb(f["dense_bytes"])),
        row(BENCH, model, "floor", "floor_s[kv]", f["kv_bytes"] / copy_bw, "s", gb(f["kv_bytes"])),
    ]


def hf_batch_throughput(model_obj, model: str, batch: int, new_tokens: int, tiny: bool,
                        device) -> tuple[float, int, float]:
    """HF `generate` on a left-padded batch of the workload's first `batch` prompts."""
    reqs = make_workload(batch, seed=0, id_stream=0, **workload_kwargs(model, tiny))
    prompts = [r.prompt for r in reqs]
    hf_generate(model_obj, prompts[:2], 2, device, temperature=0.6)  # warm up
    tokens, secs = timed(lambda: hf_generate(model_obj, prompts, new_tokens, device,
                                             temperature=0.6), device)
    log(f"HF generate {model} batch {batch}: {tokens} tokens in {secs:.2f}s "
        f"= {tokens / secs:,.0f} tok/s")
    return tokens / secs, tokens, secs


def main(model: str = "qwen3-30b-a3b", device: str | None = None, dtype=None,
         num_requests: int = 256, tput_repeats: int = 1, lat_repeats: int = 3, hf: bool = True,
         hf_batch: int = 32, hf_batch_new_tokens: int = 64, hf_decode_tokens: int = 32,
         tiny: bool = False, floors: bool = True, engine_kwargs: dict | None = None,
         count_experts: bool = False) -> list[dict]:
    model, dev, dtype = bench_setup(model, device, dtype, tiny)
    shape = dict(TINY if tiny else FULL)
    id_high = workload_kwargs(model, tiny)["id_high"]
    rows: list[dict] = measure_floors(dev) if floors else []
    ours_lat: list[dict] = []
    ours_tput = None
    llm = None
    try:
        kwargs = dict(trace_history=TRACE_HISTORY, record_expert_load=count_experts)
        llm = build_engine(model, dev, dtype, max_model_len=4096 if not tiny else 256,
                           **dict(kwargs, **(engine_kwargs or {})))
        try:
            res = glassbox_latency(llm, dev, id_high, repeats=lat_repeats, **shape)
            log(f"glassbox {model}: {res['decode_tok_s']:,.1f} tok/s, TTFT {res['ttft_ms']:.2f} ms")
            ours_lat = latency_rows(BENCH, model, "glassbox", res, shape)
            rows += ours_lat
        except Exception as exc:
            rows.append(error_row(BENCH, model, "glassbox", exc))
        warmup_glassbox(llm, model, tiny, dev)
        copy_bw = copy_bandwidth(rows, dev)
        runs = throughput_with_floor(llm, model, num_requests, tput_repeats, tiny, dev, copy_bw,
                                     count_experts)
        tput_rows = floor_rows(model, runs, num_requests, copy_bw)
        ours_tput = tput_rows[0]
        rows += tput_rows
    except Exception as exc:
        rows.append(error_row(BENCH, model, "glassbox", exc))
    finally:
        shutdown_engine(llm)
        llm = None
        free_memory(dev)
    if hf:
        def peer_figures(hf_model) -> None:
            hf_shape = dict(shape, new_tokens=min(hf_decode_tokens, shape["new_tokens"]))
            try:
                res = hf_latency(hf_model, dev, id_high, repeats=1, ttft_repeats=2, **hf_shape)
                log(f"HF {model}: {res['decode_tok_s']:,.1f} tok/s, TTFT {res['ttft_ms']:.2f} ms")
                peer_lat = latency_rows(BENCH, model, "hf-generate", res, hf_shape)
                rows.extend(peer_lat)
                rows.extend(compare_rows(BENCH, model, ours_lat, peer_lat))
            except Exception as exc:
                rows.append(error_row(BENCH, model, "hf-generate", exc))
            batch = min(hf_batch, 2) if tiny else hf_batch
            new = min(hf_batch_new_tokens, 4) if tiny else hf_batch_new_tokens
            tok_s, tokens, _ = hf_batch_throughput(hf_model, model, batch, new, tiny, dev)
            peer_tput = row(BENCH, model, "hf-generate", "output_tok_s", tok_s, "tok/s",
                            f"batch {batch}, {new} new tok each, 1 run")
            rows.append(peer_tput)
            rows.extend(ratio_row(BENCH, model, "output_tok_s", ours_tput, peer_tput))
        hf_peer(rows, BENCH, model, dev, dtype, peer_figures)
    return rows


def cli(argv=None) -> list[dict]:
    p = base_parser(__doc__)
    p.set_defaults(model="qwen3-30b-a3b")
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--repeats", type=int, default=1, help="throughput repeats")
    p.add_argument("--hf-batch", type=int, default=32)
    p.add_argument("--hf-batch-new-tokens", type=int, default=64)
    p.add_argument("--hf-decode-tokens", type=int, default=32)
    p.add_argument("--count-experts", action="store_true",
                   help="count the distinct experts per step from the engine's expert load (a probe: "
                        "its cost is in the figure) instead of the uniform-routing estimate")
    a = p.parse_args(argv)
    lat_repeats = 3
    if a.tiny:
        a.num_requests, lat_repeats = min(a.num_requests, 6), 1
    rows = main(a.model, a.device, a.dtype, a.num_requests, a.repeats, lat_repeats, not a.no_hf,
                a.hf_batch, a.hf_batch_new_tokens, a.hf_decode_tokens, a.tiny, not a.no_floors,
                count_experts=a.count_experts)
    finish_cli(rows, "moe", a.json)
    return rows


if __name__ == "__main__":
    cli()
