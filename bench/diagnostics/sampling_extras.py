"""What the sampler's extras cost: batch-1 decode with a JSON-schema grammar (target <= 10 %
slower than without) and offline throughput with presence / frequency / repetition penalties
on every request (target <= 3 %). Prints one JSON object.

    python bench/diagnostics/sampling_extras.py --model Qwen/Qwen3-0.6B          # a GPU
    python bench/diagnostics/sampling_extras.py --shape qwen3-0.6b --only penalties   # its shapes, dummy
    python bench/diagnostics/sampling_extras.py --shape qwen3-0.6b --tokenizer DIR    # + a tokenizer
                                   # (tools/make_bpe_tokenizer.py DIR: a Qwen-sized BPE)
    python bench/diagnostics/sampling_extras.py --tiny                           # CPU smoke run
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine import LLM, SamplingParams  # noqa: E402

# never completes within the run: every step is masked (minItems above max_tokens)
SCHEMA = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999},
          "minItems": 4096}


def _timed(fn, repeats: int) -> float:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=str(Path(__file__).resolve().parents[2] / "assets" /
                                          "demo-qwen3"))
    p.add_argument("--tiny", action="store_true", help="few tokens, few requests (CPU)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tokens", type=int, help="batch-1 tokens per run (default 256, tiny 32)")
    p.add_argument("--requests", type=int, help="throughput requests (default 256, tiny 8)")
    p.add_argument("--output-len", type=int, help="throughput tokens per request (128, tiny 16)")
    p.add_argument("--only", choices=("guided", "penalties"), help="run one of the two")
    p.add_argument("--shape", help="a named shape of bench/common.py (e.g. qwen3-0.6b) with "
                   "dummy weights instead of --model; it has no tokenizer, so penalties only")
    p.add_argument("--tokenizer", help="with --shape: a directory whose tokenizer files go "
                   "beside the shape's config (tools/make_bpe_tokenizer.py makes a Qwen-sized "
                   "one), so the grammar runs too")
    a = p.parse_args(argv)
    n_tok, n_req, out_len = (32, 8, 16) if a.tiny else (256, 256, 128)
    n_tok, n_req, out_len = a.tokens or n_tok, a.requests or n_req, a.output_len or out_len
    if a.shape and a.only != "penalties" and not a.tokenizer:
        p.error("--shape has no tokenizer (a grammar needs one): add --tokenizer DIR or "
                "--only penalties, or give a checkpoint with --model")
    if a.shape and a.tokenizer:
        llm = _shape_with_tokenizer(a.shape, a.tokenizer)
    elif a.shape:
        from common import build_engine, resolve_device
        llm = build_engine(a.shape, resolve_device(None))
    else:
        llm = LLM(a.model)
    res = {"model": a.shape or a.model, "device": llm.device,
           "vocab": len(llm.tokenizer) if llm.tokenizer is not None else None}
    try:
        if a.only != "penalties":
            res.update(_guided(llm, n_tok, a.repeats))
        if a.only != "guided":
            res.update(_penalties(llm, n_req, out_len, a.repeats))
    finally:
        llm.shutdown()
    print(json.dumps(res, indent=1))
    return res


def _shape_with_tokenizer(shape: str, tok_dir: str):
    """The named shape's config (dummy weights) beside the given tokenizer's files."""
    import shutil
    import tempfile
    from bench.common import default_dtype, model_dir, resolve_device
    d = Path(tempfile.mkdtemp(prefix="glassbox-shape-"))
    shutil.copy(Path(model_dir(shape)) / "config.json", d / "config.json")
    for f in Path(tok_dir).iterdir():
        if f.name.startswith("tokenizer"):
            shutil.copy(f, d / f.name)
    dev = resolve_device(None)
    return LLM(str(d), device=str(dev), dtype=default_dtype(dev), load_format="dummy")


def _streamed_ms(llm, prompt, params) -> float:
    """ms per token between the first and the last streamed token: what an API client that
    streams sees (a consumer thread wakes per token and takes the GIL from the engine's)."""
    times = [time.perf_counter() for ev in llm.stream(prompt, params) if ev.token_id is not None]
    return 1e3 * (times[-1] - times[0]) / (len(times) - 1)


def _guided(llm, n_tok: int, repeats: int) -> dict:
    prompt = "Write numbers:"
    plain = SamplingParams(temperature=0.7, seed=0, max_tokens=n_tok, ignore_eos=True)
    guided = SamplingParams(temperature=0.7, seed=0, max_tokens=n_tok, ignore_eos=True,
                            guided={"json_schema": SCHEMA})
    llm.generate([prompt], plain)                       # warm-up (graphs, caches)
    llm.generate([prompt], guided)
    t_plain = _timed(lambda: llm.generate([prompt], plain), repeats)
    t_guided = _timed(lambda: llm.generate([prompt], guided), repeats)
    # streamed, plain and guided alternating (run-to-run drift lands on both)
    ms = {"plain": [], "guided": []}
    for _ in range(repeats):
        for name, sp in (("plain", plain), ("guided", guided)):
            ms[name].append(_streamed_ms(llm, prompt, sp))
    sp_, sg = statistics.median(ms["plain"]), statistics.median(ms["guided"])
    return {"batch1_decode_tok_s": n_tok / t_plain, "batch1_guided_tok_s": n_tok / t_guided,
            "guided_cost_pct": 100 * (t_guided / t_plain - 1),
            "streamed_ms_per_token": sp_, "streamed_guided_ms_per_token": sg,
            "streamed_guided_cost_pct": 100 * (sg / sp_ - 1)}


def _penalties(llm, n_req: int, out_len: int, repeats: int) -> dict:
    prompts = [[(i * 7 + j) % 1000 + 10 for j in range(64)] for i in range(n_req)]
    base = SamplingParams(temperature=0.6, seed=1, max_tokens=out_len, ignore_eos=True)
    pen = SamplingParams(temperature=0.6, seed=1, max_tokens=out_len, ignore_eos=True,
                         presence_penalty=0.5, frequency_penalty=0.5,
                         repetition_penalty=1.1)
    llm.generate(prompts[:4], base)
    llm.generate(prompts[:4], pen)
    t_base = _timed(lambda: llm.generate(prompts, base), repeats)
    t_pen = _timed(lambda: llm.generate(prompts, pen), repeats)
    return {"throughput_tok_s": n_req * out_len / t_base,
            "throughput_penalties_tok_s": n_req * out_len / t_pen,
            "penalties_cost_pct": 100 * (t_pen / t_base - 1)}


if __name__ == "__main__":
    main()
