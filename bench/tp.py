"""Tensor parallelism: batch-1 latency and throughput at TP = 1, 2 (4, 8 where lent), each
engine in its own process, side by side in one run; scaling vs TP=1, the all-reduce time per
step measured by the engine (`StepTrace.collective_time`), and the batch-1 bandwidth floor
(weight bytes per GPU per token / measured copy bandwidth).

    python bench/tp.py                                  # 0.6B and 30B-A3B at TP 1, 2
    python bench/tp.py --models qwen2.5-72b --tp 1,2    # TP=1 is refused: no H200 holds it
    python bench/tp.py --tiny --device cpu --tp 1,2     # smoke run over gloo
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (TINY_OF, base_parser, build_engine, log, measure_copy_bandwidth,
                          model_dir, resolve_device, shutdown_engine, vocab_size)

LATENCY = dict(prompt_len=128, new_tokens=256, ttft_prompt_len=1024)
TINY_LATENCY = dict(prompt_len=16, new_tokens=8, ttft_prompt_len=32)
THROUGHPUT_REQUESTS = {"qwen3-0.6b": 256, "qwen3-30b-a3b": 128, "qwen2.5-72b": 64,
                       "qwen3-235b-a22b": 64}


def _active_params(cfg) -> int:
    """Parameters one decode token reads: not the embedding table (one row of it; with tied
    embeddings the table is read once, as the LM head), and of MoE layers top_k of E experts."""
    from engine.model_size import param_count
    total = param_count(cfg)
    if not getattr(cfg, "tie_word_embeddings", False):
        total -= cfg.vocab_size * cfg.hidden_size
    E = getattr(cfg, "num_experts", 0)
    if not E:
        return total
    from engine.models.qwen_moe import is_moe_layer
    moe = sum(is_moe_layer(cfg, i) for i in range(cfg.num_hidden_layers))
    experts = moe * E * 3 * cfg.hidden_size * cfg.moe_intermediate_size
    return total - experts + experts * cfg.num_experts_per_tok // E


def _collectives(llm, since: int) -> dict:
    """All-reduce time per decode step where the engine measured it, and collectives/step."""
    steps = [s for s in llm.inspect().steps if s.step_id >= since and s.num_prefill_tokens == 0]
    timed = [s.collective_time for s in steps if s.collective_time is not None]
    return {"allreduce_us_per_step": 1e6 * statistics.median(timed) if timed else None,
            "timed_steps": len(timed),
            "collectives_per_step": steps[-1].collectives if steps else None}


def worker(model: str, tp: int, device: str, tiny: bool, throughput: bool, latency: bool,
           num_requests: int | None) -> dict:
    """One engine, one process: the figures for one (model, tp)."""
    from bench.latency import glassbox_latency
    from bench.throughput import glassbox_throughput, warmup_glassbox
    dev = resolve_device(device)
    name = TINY_OF.get(model, model) if tiny else model
    out: dict = {"model": model, "tp": tp}
    try:
        llm = build_engine(name, dev, tensor_parallel_size=tp,
                           max_model_len=256 if tiny else 4096)
    except (ValueError, RuntimeError) as e:         # e.g. the 72B at TP=1: refused, by design
        out["refused"] = str(e)
        return out
    try:
        from transformers import AutoConfig
        cfg = AutoConfig.from_pretrained(model_dir(name))
        if dev.type == "cuda":
            bw = measure_copy_bandwidth(dev)
            out["floor_tok_s"] = bw / (_active_params(cfg) * 2 / tp)
            out["copy_tb_s"] = bw / 1e12
        if latency:
            since = llm.core.step_id
            shape = TINY_LATENCY if tiny else LATENCY
            res = glassbox_latency(llm, dev, min(10000, vocab_size(name)), repeats=3, **shape)
            out.update(decode_tok_s=res["decode_tok_s"], ms_per_token=res["ms_per_token"],
                       ttft_ms=res["ttft_ms"])
            out.update({f"latency_{k}": v for k, v in _collectives(llm, since).items()})
        if throughput:
            since = llm.core.step_id
            n = num_requests or (16 if tiny else THROUGHPUT_REQUESTS.get(model, 128))
            warmup_glassbox(llm, name, tiny, dev)
            samples, tokens = glassbox_throughput(llm, name, n, 1, tiny, dev)
            out.update(throughput_tok_s=samples[0], throughput_requests=n)
            out.update({f"throughput_{k}": v for k, v in _collectives(llm, since).items()})
    except Exception as e:          # noqa: BLE001 — report, do not lose the other figures
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        shutdown_engine(llm)
    return out


def _table(results: list[dict]) -> str:
    base = {r["model"]: r for r in results if r["tp"] == 1 and "refused" not in r}
    cols = ["model", "tp", "decode tok/s", "ms/token", "x TP=1", "% floor", "TTFT ms",
            "throughput tok/s", "x TP=1 ", "all-reduce µs/step (b=1)", "collectives/step"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in results:
        if "refused" in r:
            lines.append(f"| {r['model']} | {r['tp']} | refused: {r['refused']} |"
                         + " |" * (len(cols) - 3))
            continue
        b = base.get(r["model"], {})

        def f(v, fmt="{:,.1f}"):
            return "" if v is None else fmt.format(v)
        dec, thr = r.get("decode_tok_s"), r.get("throughput_tok_s")
        cells = [r["model"], str(r["tp"]), f(dec), f(r.get("ms_per_token"), "{:.3f}"),
                 f(dec / b["decode_tok_s"] if dec and b.get("decode_tok_s") else None, "{:.2f}"),
                 f(100 * dec / r["floor_tok_s"] if dec and r.get("floor_tok_s") else None,
                   "{:.0f} %"),
                 f(r.get("ttft_ms"), "{:.2f}"), f(thr, "{:,.0f}"),
                 f(thr / b["throughput_tok_s"] if thr and b.get("throughput_tok_s") else None,
                   "{:.2f}"),
                 f(r.get("latency_allreduce_us_per_step"), "{:.0f}"),
                 str(r.get("latency_collectives_per_step") or "")]
        if "error" in r:
            cells[-1] += f" (error: {r['error']})"
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    p = base_parser(__doc__)
    p.add_argument("--models", default="qwen3-0.6b,qwen3-30b-a3b")
    p.add_argument("--tp", default="1,2", help="comma list of tensor-parallel sizes")
    p.add_argument("--no-throughput", action="store_true")
    p.add_argument("--no-latency", action="store_true")
    p.add_argument("--num-requests", type=int, default=None)
    p.add_argument("--timeout-s", type=float, default=900, help="per engine process")
    p.add_argument("--worker", action="store_true", help=argparse_hidden())
    a = p.parse_args(argv)
    if a.worker:
        res = worker(a.model, int(a.tp), a.device, a.tiny, not a.no_throughput,
                     not a.no_latency, a.num_requests)
        print("RESULT " + json.dumps(res), flush=True)
        return [res]
    results = []
    for model in a.models.split(","):
        for tp in (int(t) for t in a.tp.split(",")):
            cmd = [sys.executable, __file__, "--worker", "--model", model, "--tp", str(tp)]
            for flag, on in (("--tiny", a.tiny), ("--no-throughput", a.no_throughput),
                             ("--no-latency", a.no_latency)):
                if on:
                    cmd.append(flag)
            if a.device:
                cmd += ["--device", a.device]
            if a.num_requests:
                cmd += ["--num-requests", str(a.num_requests)]
            log(f"tp bench: {model} at TP={tp}")
            t0 = time.perf_counter()
            try:
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout_s,
                                      env=dict(os.environ, PYTHONUNBUFFERED="1"))
                lines = [l for l in done.stdout.splitlines() if l.startswith("RESULT ")]
                res = json.loads(lines[-1][7:]) if lines else {
                    "model": model, "tp": tp,
                    "error": f"exit {done.returncode}: {done.stderr.strip()[-600:]}"}
            except subprocess.TimeoutExpired:
                res = {"model": model, "tp": tp, "error": f"timed out after {a.timeout_s:.0f}s"}
            res["wall_s"] = time.perf_counter() - t0
            log(f"  -> {res}")
            results.append(res)
    print(_table(results))
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=2))
    return results


def argparse_hidden():
    import argparse
    return argparse.SUPPRESS


if __name__ == "__main__":
    main()
