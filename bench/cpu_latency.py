"""Batch-1 decode on the CPU in fp32: the demo checkpoint (when present) and Qwen3-0.6B shapes with
dummy weights, glassbox vs HF `model.generate` in the same run (tok/s and ratio)."""
from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.common import (DEMO_DIR, base_parser, build_engine, cpu_threads, error_row, finish_cli,
                          free_memory, hf_peer, log, measure_floors, parse_dtype, resolve_device,
                          shutdown_engine, vocab_size)
from bench.latency import TINY, compare_rows, glassbox_latency, hf_latency, latency_rows

BENCH = "cpu"
# Per model: the latency protocol scaled to what 2 cores finish in about a minute each.
SHAPES = {
    "demo": dict(prompt_len=128, new_tokens=128, ttft_prompt_len=128),
    "qwen3-0.6b": dict(prompt_len=32, new_tokens=8, ttft_prompt_len=32),
    "tiny": TINY,
}
REPEATS = {"demo": (3, 2), "qwen3-0.6b": (1, 1), "tiny": (1, 1)}  # (glassbox, HF)


def default_models(tiny: bool) -> list[str]:
    if tiny:
        return ["tiny"]
    models = ["qwen3-0.6b"]
    if (DEMO_DIR / "config.json").exists():
        models.insert(0, "demo")
    else:
        log(f"no demo checkpoint at {DEMO_DIR}: measuring Qwen3-0.6B shapes only")
    return models


def measure_model(model: str, hf: bool, dtype: torch.dtype) -> list[dict]:
    dev = torch.device("cpu")
    shape = SHAPES[model]
    ours_rep, hf_rep = REPEATS[model]
    id_high = min(10000, vocab_size(model))
    max_len = 2 * max(shape["prompt_len"] + shape["new_tokens"], shape["ttft_prompt_len"] + 2)
    rows: list[dict] = []
    ours: list[dict] = []
    llm = None
    try:
        llm = build_engine(model, dev, dtype, max_model_len=max_len)
        res = glassbox_latency(llm, dev, id_high, repeats=ours_rep, ttft_repeats=1, **shape)
        log(f"glassbox cpu {model}: {res['decode_tok_s']:,.1f} tok/s")
        ours = latency_rows(BENCH, model, "glassbox", res, shape)
        rows += ours
    except Exception as exc:
        rows.append(error_row(BENCH, model, "glassbox", exc))
    finally:
        shutdown_engine(llm)
        llm = None
        free_memory(dev)
    if hf:
        def peer_figures(hf_model) -> list[dict]:
            res = hf_latency(hf_model, dev, id_high, repeats=hf_rep, ttft_repeats=1, **shape)
            log(f"HF cpu {model}: {res['decode_tok_s']:,.1f} tok/s")
            peer = latency_rows(BENCH, model, "hf-generate", res, shape)
            rows.extend(peer)
            return peer
        peer = hf_peer(rows, BENCH, model, dev, dtype, peer_figures) or []
        rows += compare_rows(BENCH, model, ours, peer)
    return rows


def main(models: list[str] | None = None, dtype=None, hf: bool = True, tiny: bool = False,
         floors: bool = True, threads: int | None = None) -> list[dict]:
    threads = threads or cpu_threads()
    torch.set_num_threads(threads)
    log(f"CPU bench with {threads} torch threads")
    dtype = parse_dtype(dtype) or torch.float32
    rows: list[dict] = []
    if floors:
        for r in measure_floors(resolve_device("cpu")):
            rows.append(dict(r, bench="cpu-floors"))
    for model in models or default_models(tiny):
        try:
            rows += measure_model(model, hf, dtype)
        except Exception as exc:
            rows.append(error_row(BENCH, model, "-", exc))
    for r in rows:  # the CPU target is stated for 2 cores: say how many this run had
        if r["bench"] == BENCH and r["metric"] != "error":
            r["note"] = f"{r['note']}, {threads} threads".lstrip(", ")
    return rows


def cli(argv=None) -> list[dict]:
    p = base_parser(__doc__)
    p.add_argument("--models", default=None,
                   help="comma list from demo,qwen3-0.6b,tiny (default: demo if present + 0.6b)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    a = p.parse_args(argv)
    models = a.models.split(",") if a.models else None
    rows = main(models, a.dtype, not a.no_hf, a.tiny, not a.no_floors, a.threads)
    finish_cli(rows, "cpu latency", a.json)
    return rows


if __name__ == "__main__":
    cli()
