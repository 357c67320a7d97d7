"""Offline throughput on the nano-vllm workload: output tok/s over wall time, glassbox vs HF
continuous batching (`generate_batch`'s engine) in the same run."""
from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (Request, base_parser, bench_setup, build_engine, error_row, finish_cli,
                          free_memory, hf_peer, log, make_workload, measure_floors, median,
                          ratio_row, row, sampling, shutdown_engine, timed, vocab_size)

TINY_WORKLOAD = dict(prompt_len=(8, 48), output_len=(4, 16))


def workload_kwargs(model: str, tiny: bool) -> dict:
    kw = dict(TINY_WORKLOAD) if tiny else {}
    kw["id_high"] = min(10000, vocab_size(model))
    return kw


def run_glassbox(llm, requests: list[Request], device, watch=None) -> tuple[float, int, float]:
    """One timed llm.generate over the workload: (output tok/s, output tokens, seconds)."""
    params = [sampling(temperature=0.6, ignore_eos=True, max_tokens=r.max_tokens) for r in requests]
    outs, secs = timed(lambda: llm.generate([r.prompt for r in requests], params, watch=watch),
                       device)
    tokens = sum(len(o.token_ids) for o in outs)
    expected = sum(r.max_tokens for r in requests)
    if tokens != expected:  # ignore_eos: every request must run to its max_tokens
        log(f"warning: glassbox produced {tokens} tokens, the workload asks for {expected}")
    return tokens / secs, tokens, secs


def warmup_glassbox(llm, model: str, tiny: bool, device) -> None:
    """Compile kernels and touch every graph bucket once, outside the timed runs: 16 of the
    workload's prompts (~8k tokens: the first step fills the token budget, as the workload's
    mixed steps do) for 1-8 tokens each, so the batch shrinks through every small size and the
    sampler's small-batch launch compiles here too (with 8 requests of 8 tokens each it first
    compiled inside a timed run: bench/RESULTS.md, 2026-12-03 fifth session)."""
    kw = workload_kwargs(model, tiny)
    reqs = make_workload(16, seed=0, id_stream=9999, **kw)
    for i, r in enumerate(reqs):
        r.max_tokens = min(r.max_tokens, 1 + i % 8)
    run_glassbox(llm, reqs, device)


def glassbox_throughput(llm, model: str, num_requests: int, repeats: int, tiny: bool,
                        device, seed: int = 0) -> tuple[list[float], int]:
    """Median-ready samples of output tok/s; repeat r keeps the lengths and changes the ids."""
    kw = workload_kwargs(model, tiny)
    samples, tokens = [], 0
    for r in range(repeats):
        reqs = make_workload(num_requests, seed=seed, id_stream=r, **kw)
        tok_s, tokens, secs = run_glassbox(llm, reqs, device)
        log(f"glassbox {model} throughput repeat {r}: {tokens} tokens in {secs:.2f}s "
            f"= {tok_s:,.0f} tok/s")
        samples.append(tok_s)
    return samples, tokens


def hf_throughput(model_obj, model: str, num_requests: int, tiny: bool, device,
                  seed: int = 0) -> tuple[float, int, float]:
    """HF continuous batching on the first `num_requests` of the same workload."""
    from bench.common import hf_generate_batch
    reqs = make_workload(num_requests, seed=seed, id_stream=0, **workload_kwargs(model, tiny))
    tokens, secs = hf_generate_batch(model_obj, reqs, device, temperature=0.6)
    log(f"HF generate_batch {model}: {tokens} tokens in {secs:.2f}s = {tokens / secs:,.0f} tok/s")
    return tokens / secs, tokens, secs


def main(model: str = "qwen3-0.6b", device: str | None = None, dtype=None,
         num_requests: int = 256, repeats: int = 3, hf: bool = True, hf_num_requests: int = 32,
         tiny: bool = False, floors: bool = True, max_model_len: int = 4096,
         engine_kwargs: dict | None = None, llm=None) -> list[dict]:
    """`llm`: an engine already built for this model (run_all shares one); else one is built."""
    model, dev, dtype = bench_setup(model, device, dtype, tiny)
    if tiny:
        max_model_len = min(max_model_len, 256)
    rows: list[dict] = measure_floors(dev) if floors else []
    ours = None
    own = llm is None
    try:
        if own:
            llm = build_engine(model, dev, dtype, max_model_len=max_model_len,
                               **(engine_kwargs or {}))
        warmup_glassbox(llm, model, tiny, dev)
        samples, tokens = glassbox_throughput(llm, model, num_requests, repeats, tiny, dev)
        ours = row("throughput", model, "glassbox", "output_tok_s", median(samples), "tok/s",
                   f"{num_requests} req, {tokens} out tok, median of {len(samples)}")
        rows.append(ours)
    except Exception as exc:
        rows.append(error_row("throughput", model, "glassbox", exc))
    finally:
        if own:
            shutdown_engine(llm)
        llm = None
        free_memory(dev)
    if hf:
        def peer_figures(hf_model) -> dict:
            tok_s, tokens, secs = hf_throughput(hf_model, model, hf_num_requests, tiny, dev)
            peer = row("throughput", model, "hf-generate_batch", "output_tok_s", tok_s, "tok/s",
                       f"{hf_num_requests} req, {tokens} out tok, 1 run")
            rows.append(peer)
            return peer
        peer = hf_peer(rows, "throughput", model, dev, dtype, peer_figures, "hf-generate_batch")
        rows += ratio_row("throughput", model, "output_tok_s", ours, peer)
    return rows


def cli(argv=None) -> list[dict]:
    p = base_parser(__doc__)
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--hf-num-requests", type=int, default=32,
                   help="HF is ~10-40x slower; it runs the first N requests of the workload")
    a = p.parse_args(argv)
    if a.tiny:
        a.num_requests, a.repeats, a.hf_num_requests = min(a.num_requests, 6), min(a.repeats, 2), 3
    rows = main(a.model, a.device, a.dtype, a.num_requests, a.repeats, not a.no_hf,
                a.hf_num_requests, a.tiny, not a.no_floors)
    finish_cli(rows, "throughput", a.json)
    return rows


if __name__ == "__main__":
    cli()
