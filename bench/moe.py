"""Qwen3-30B-A3B shapes: batch-1 latency and throughput, glassbox vs HF (batch-1 generate, and
generate at batch 32 for throughput). Both models are ~60 GB in bf16, so they run one after the
other: ours is built, measured and freed before HF is built."""
from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (base_parser, build_engine, build_hf, error_row, finish_cli,
                          free_memory, hf_generate, log, make_workload, measure_floors, median,
                          parse_dtype, ratio_row, resolve_device, row, shutdown_engine, timed,
                          TINY_OF)
from bench.latency import FULL, TINY, compare_rows, glassbox_latency, hf_latency, latency_rows
from bench.throughput import (glassbox_throughput, warmup_glassbox, workload_kwargs)

BENCH = "moe"


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
         tiny: bool = False, floors: bool = True, engine_kwargs: dict | None = None) -> list[dict]:
    dev = resolve_device(device)
    dtype = parse_dtype(dtype)
    if tiny:
        model = TINY_OF.get(model, model)
    shape = dict(TINY if tiny else FULL)
    id_high = workload_kwargs(model, tiny)["id_high"]
    rows: list[dict] = measure_floors(dev) if floors else []
    ours_lat: list[dict] = []
    ours_tput = peer_tput = None
    llm = None
    try:
        llm = build_engine(model, dev, dtype, max_model_len=4096 if not tiny else 256,
                           **(engine_kwargs or {}))
        try:
            res = glassbox_latency(llm, dev, id_high, repeats=lat_repeats, **shape)
            log(f"glassbox {model}: {res['decode_tok_s']:,.1f} tok/s, TTFT {res['ttft_ms']:.2f} ms")
            ours_lat = latency_rows(BENCH, model, "glassbox", res, shape)
            rows += ours_lat
        except Exception as exc:
            rows.append(error_row(BENCH, model, "glassbox", exc))
        warmup_glassbox(llm, model, tiny, dev)
        samples, tokens = glassbox_throughput(llm, model, num_requests, tput_repeats, tiny, dev)
        ours_tput = row(BENCH, model, "glassbox", "output_tok_s", median(samples), "tok/s",
                        f"{num_requests} req, {tokens} out tok, median of {len(samples)}")
        rows.append(ours_tput)
    except Exception as exc:
        rows.append(error_row(BENCH, model, "glassbox", exc))
    finally:
        shutdown_engine(llm)
        llm = None
        free_memory(dev)
    if not hf:
        return rows
    hf_model = None
    try:
        hf_model = build_hf(model, dev, dtype)
        hf_shape = dict(shape, new_tokens=min(hf_decode_tokens, shape["new_tokens"]))
        try:
            res = hf_latency(hf_model, dev, id_high, repeats=1, ttft_repeats=2, **hf_shape)
            log(f"HF {model}: {res['decode_tok_s']:,.1f} tok/s, TTFT {res['ttft_ms']:.2f} ms")
            peer_lat = latency_rows(BENCH, model, "hf-generate", res, hf_shape)
            rows += peer_lat
            rows += compare_rows(BENCH, model, ours_lat, peer_lat)
        except Exception as exc:
            rows.append(error_row(BENCH, model, "hf-generate", exc))
        batch = min(hf_batch, 2) if tiny else hf_batch
        new = min(hf_batch_new_tokens, 4) if tiny else hf_batch_new_tokens
        tok_s, tokens, _ = hf_batch_throughput(hf_model, model, batch, new, tiny, dev)
        peer_tput = row(BENCH, model, "hf-generate", "output_tok_s", tok_s, "tok/s",
                        f"batch {batch}, {new} new tok each, 1 run")
        rows.append(peer_tput)
        rows += ratio_row(BENCH, model, "output_tok_s", ours_tput, peer_tput)
    except Exception as exc:
        rows.append(error_row(BENCH, model, "hf-generate", exc))
    finally:
        del hf_model
        free_memory(dev)
    return rows


def cli(argv=None) -> list[dict]:
    p = base_parser(__doc__)
    p.set_defaults(model="qwen3-30b-a3b")
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--repeats", type=int, default=1, help="throughput repeats")
    p.add_argument("--hf-batch", type=int, default=32)
    p.add_argument("--hf-batch-new-tokens", type=int, default=64)
    p.add_argument("--hf-decode-tokens", type=int, default=32)
    a = p.parse_args(argv)
    lat_repeats = 3
    if a.tiny:
        a.num_requests, lat_repeats = min(a.num_requests, 6), 1
    rows = main(a.model, a.device, a.dtype, a.num_requests, a.repeats, lat_repeats, not a.no_hf,
                a.hf_batch, a.hf_batch_new_tokens, a.hf_decode_tokens, a.tiny, not a.no_floors)
    finish_cli(rows, "moe", a.json)
    return rows


if __name__ == "__main__":
    cli()
