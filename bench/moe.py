"""Qwen3-30B-A3B shapes: batch-1 latency and throughput, glassbox vs HF (batch-1 generate, and
generate at batch 32 for throughput). Both models are ~60 GB in bf16, so they run one after the
other: ours is built, measured and freed before HF is built.

Throughput runs the dense `throughput` workload (256 requests) and prints beside it the
workload's bandwidth floor: the bytes each step of the run had to read at its batch, summed over
the run's step traces, over the measured copy bandwidth. A step reads, at the least:
- experts: in each MoE layer, every expert that one of the step's tokens routes to, once. Either
  the uniform-routing expectation for B tokens, E * (1 - (1 - k/E)^B) (a token's k experts are
  distinct, so an expert escapes one token with probability 1 - k/E), or with --count-experts
  counted from the engine's expert load (the figure then carries that probe's cost);
- dense weights: everything else the forward multiplies by (attention projections, norms, router
  gates, shared experts, dense MLPs, the LM head), plus one embedding row per token;
- the KV cache: K and V of every token each scheduled request attends over.
Only real tokens count: the rows a CUDA-graph bucket pads with are the engine's cost, not the
workload's. Time per step = bytes / copy bandwidth (read + write bytes of a device copy, as
bench/common.py measures it); FLOPs are not counted, so prefill steps' floor is low."""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (base_parser, bench_setup, build_engine, error_row, finish_cli,
                          free_memory, hf_generate, hf_peer, log, make_workload,
                          measure_copy_bandwidth, measure_floors, ratio_row, row, shutdown_engine,
                          timed)
from bench.latency import FULL, TINY, compare_rows, glassbox_latency, hf_latency, latency_rows
from bench.throughput import run_glassbox, warmup_glassbox, workload_kwargs

BENCH = "moe"
# every step of a run stays in the engine's step history, for the floor (a run has ~2,000 steps)
TRACE_HISTORY = 1 << 16


# ---------------------------------------------------------------- the workload's bandwidth floor

@dataclass(frozen=True)
class ModelBytes:
    """What one forward reads, by kind, for the model on rank 0 (TP=1: the whole model)."""
    expert: int          # one expert of one MoE layer (w13 + w2)
    num_experts: int
    top_k: int
    moe_layers: int
    dense: int           # read once a step whatever the batch
    embed_row: int       # read once per token (untied embeddings; tied: the head reads the table)
    kv_per_token: int    # K + V of one context token, all layers


def model_bytes(llm) -> ModelBytes:
    """From the engine's own parameters (shared tensors counted once)."""
    from engine.layers.moe import FusedMoE
    model, _ = llm.model_parts()
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    moes = [m for m in model.modules() if isinstance(m, FusedMoE)]
    expert_total = sum(m.w13.numel() * m.w13.element_size() + m.w2.numel() * m.w2.element_size()
                       for m in moes)
    num_experts = moes[0].num_experts if moes else 0
    embed = model.model.embed_tokens.weight
    tied = embed.data_ptr() == model.lm_head.weight.data_ptr()
    table = 0 if tied else embed.numel() * embed.element_size()
    return ModelBytes(expert=expert_total // max(1, num_experts * len(moes)),
                      num_experts=num_experts, top_k=moes[0].top_k if moes else 0,
                      moe_layers=len(moes), dense=total - expert_total - table,
                      embed_row=embed.shape[1] * embed.element_size(),
                      kv_per_token=llm.inspect().kv_layout.bytes_per_token)


def expected_experts(tokens: int, num_experts: int, top_k: int) -> float:
    """Distinct experts a layer reads for `tokens` tokens under uniform routing."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def step_tokens(step) -> int:
    return step.num_prefill_tokens + step.num_decode_tokens


def step_bytes(step, mb: ModelBytes, counted: bool) -> tuple[float, float, float]:
    """(expert, dense, KV) bytes step `step` (a StepTrace) must read. counted: the distinct
    experts from the step's expert load (which weighs graph padding rows 0)."""
    n = step_tokens(step)
    if counted and step.expert_load is not None:
        experts = float((np.asarray(step.expert_load) > 0).sum())       # over all MoE layers
    else:
        experts = mb.moe_layers * expected_experts(n, mb.num_experts, mb.top_k)
    context = sum(e.start_pos + e.num_tokens for e in step.entries)
    return experts * mb.expert, float(mb.dense + n * mb.embed_row), float(context * mb.kv_per_token)


def run_floor(steps, mb: ModelBytes, copy_bw: float, counted: bool = False) -> dict:
    """The floor of a run from its step traces: seconds, tok/s for `output_tokens`, and the
    bytes by kind. copy_bw in bytes/s."""
    parts = np.array([step_bytes(s, mb, counted) for s in steps]).reshape(-1, 3)
    expert, dense, kv = parts.sum(0)
    decode = [s for s in steps if s.num_prefill_tokens == 0]
    seconds = (expert + dense + kv) / copy_bw
    return dict(seconds=seconds, expert_bytes=expert, dense_bytes=dense, kv_bytes=kv,
                steps=len(steps), decode_steps=len(decode),
                mean_decode_batch=float(np.mean([step_tokens(s) for s in decode])) if decode else 0.0,
                experts_per_layer=(expert / mb.expert / mb.moe_layers / len(steps)
                                   if steps and mb.moe_layers else 0.0),
                counted=bool(counted and any(s.expert_load is not None for s in steps)))


def copy_bandwidth(floor_rows: list[dict], device: torch.device) -> float:
    """bytes/s: from measure_floors' rows when the run measured them, else measured now."""
    for r in floor_rows:
        if r.get("metric") == "copy_bandwidth" and r.get("value"):
            return r["value"] * 1e12
    return measure_copy_bandwidth(device)


# ---------------------------------------------------------------- the runs

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
