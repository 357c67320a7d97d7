"""Batch-1 latency: decode tok/s and ms/token (128-token prompt, 256 greedy tokens) and TTFT of a
1,024-token prompt, glassbox vs HF `model.generate` (eager) in the same run.

--cpu: batch-1 decode on the CPU in fp32, the demo checkpoint (when present) and Qwen3-0.6B shapes
with dummy weights (--models), each on a protocol scaled to what 2 cores finish in about a minute
(tok/s and the ratio to HF); the CPU target is stated for 2 cores, so --threads 2."""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (DEMO_DIR, base_parser, bench_setup, build_engine, cpu_threads,
                          error_row, finish_cli, free_memory, hf_generate, hf_peer, log,
                          measure_floors, median, parse_dtype, random_prompt, ratio_row,
                          resolve_device, row, sampling, shutdown_engine, timed, vocab_size)

FULL = dict(prompt_len=128, new_tokens=256, ttft_prompt_len=1024)
TINY = dict(prompt_len=16, new_tokens=8, ttft_prompt_len=32)
# --cpu, per model: the protocol scaled to what 2 cores finish in about a minute each, and the
# (glassbox, HF) repeats
CPU_SHAPES = {
    "demo": dict(prompt_len=128, new_tokens=128, ttft_prompt_len=128),
    "qwen3-0.6b": dict(prompt_len=32, new_tokens=8, ttft_prompt_len=32),
    "tiny": TINY,
}
CPU_REPEATS = {"demo": (3, 2), "qwen3-0.6b": (1, 1), "tiny": (1, 1)}


def _greedy(n: int):
    return sampling(temperature=0.0, ignore_eos=True, max_tokens=n)


def glassbox_decode_ms(llm, prompt: list[int], new_tokens: int, watch=None) -> float:
    """ms per decoded token inside one streamed request: (last token time - first token time) /
    (tokens - 1). One run, so no noisy difference of two runs; prefill is excluded by design."""
    times = []
    for ev in llm.stream(prompt, _greedy(new_tokens), watch=watch):
        if ev.token_id is not None:
            times.append(time.perf_counter())
    if len(times) < 2:
        raise RuntimeError(f"asked for {new_tokens} tokens, the stream gave {len(times)}")
    return 1e3 * (times[-1] - times[0]) / (len(times) - 1)


def glassbox_latency(llm, device, id_high: int, prompt_len: int, new_tokens: int,
                     ttft_prompt_len: int, repeats: int = 3, ttft_repeats: int = 5,
                     watch=None, stream0: int = 0, warmup: bool = True) -> dict:
    """Median decode ms/token and TTFT, each run on fresh prompt ids so the prefix cache never
    hits. TTFT = wall time of a max_tokens=1 request."""
    if warmup:  # compile the prefill shapes and the batch-1 decode graph outside the timings
        llm.generate([random_prompt(ttft_prompt_len, id_high, stream0 + 900)], _greedy(2),
                     watch=watch)
        llm.generate([random_prompt(prompt_len, id_high, stream0 + 901)], _greedy(4), watch=watch)
    ms_per_token, ttft = [], []
    for r in range(repeats):
        prompt = random_prompt(prompt_len, id_high, stream0 + 10 * r)
        ms_per_token.append(glassbox_decode_ms(llm, prompt, new_tokens, watch))
    for r in range(ttft_repeats):
        prompt = random_prompt(ttft_prompt_len, id_high, stream0 + 500 + r)
        _, t = timed(lambda: llm.generate([prompt], _greedy(1), watch=watch), device)
        ttft.append(1e3 * t)
    ms = median(ms_per_token)
    return {"ms_per_token": ms, "decode_tok_s": 1e3 / ms, "ttft_ms": median(ttft),
            "repeats": repeats, "ttft_repeats": ttft_repeats}


class _TokenClock:
    """HF streamer that timestamps each generated token (the first put() is the prompt)."""

    def __init__(self):
        self.times: list[float] = []
        self._seen_prompt = False

    def put(self, value) -> None:
        value.cpu()  # wait for the token to exist before stamping it
        if self._seen_prompt:
            self.times.append(time.perf_counter())
        self._seen_prompt = True

    def end(self) -> None:
        pass


def hf_decode_ms(model_obj, prompt: list[int], new_tokens: int, device) -> float:
    clock = _TokenClock()
    hf_generate(model_obj, [prompt], new_tokens, device, streamer=clock)
    if len(clock.times) < 2:
        raise RuntimeError(f"asked HF for {new_tokens} tokens, it streamed {len(clock.times)}")
    return 1e3 * (clock.times[-1] - clock.times[0]) / (len(clock.times) - 1)


def hf_latency(model_obj, device, id_high: int, prompt_len: int, new_tokens: int,
               ttft_prompt_len: int, repeats: int = 2, ttft_repeats: int = 3) -> dict:
    """Same protocol on HF `model.generate` (dynamic cache, eager)."""
    hf_generate(model_obj, [random_prompt(prompt_len, id_high, 901)], 4, device)
    ms_per_token, ttft = [], []
    for r in range(repeats):
        prompt = random_prompt(prompt_len, id_high, r)
        ms_per_token.append(hf_decode_ms(model_obj, prompt, new_tokens, device))
    for r in range(ttft_repeats):
        prompt = random_prompt(ttft_prompt_len, id_high, 500 + r)
        _, t = timed(lambda: hf_generate(model_obj, [prompt], 1, device), device)
        ttft.append(1e3 * t)
    ms = median(ms_per_token)
    return {"ms_per_token": ms, "decode_tok_s": 1e3 / ms, "ttft_ms": median(ttft),
            "repeats": repeats, "ttft_repeats": ttft_repeats}


def latency_rows(bench: str, model: str, system: str, res: dict, shape: dict) -> list[dict]:
    note = (f"{shape['prompt_len']}-tok prompt, {shape['new_tokens']} new, "
            f"median of {res['repeats']}")
    return [row(bench, model, system, "decode_tok_s", res["decode_tok_s"], "tok/s", note),
            row(bench, model, system, "ms_per_token", res["ms_per_token"], "ms", note),
            row(bench, model, system, f"ttft_ms_{shape['ttft_prompt_len']}", res["ttft_ms"], "ms",
                f"max_tokens=1, median of {res['ttft_repeats']}")]


def compare_rows(bench: str, model: str, ours: list[dict], peer: list[dict]) -> list[dict]:
    def find(rows, metric):
        return next((r for r in rows if r["metric"] == metric), None)
    out = ratio_row(bench, model, "decode_tok_s", find(ours, "decode_tok_s"),
                    find(peer, "decode_tok_s"))
    ttft = next((r["metric"] for r in ours if r["metric"].startswith("ttft_ms")), None)
    if ttft:
        out += ratio_row(bench, model, ttft, find(ours, ttft), find(peer, ttft),
                         higher_is_better=False)
    return out


def main(model: str = "qwen3-0.6b", device: str | None = None, dtype=None, repeats: int = 3,
         hf: bool = True, hf_repeats: int = 2, tiny: bool = False, floors: bool = True,
         bench: str = "latency", hf_new_tokens: int | None = None,
         engine_kwargs: dict | None = None, llm=None, shape: dict | None = None,
         ttft_repeats: int = 5, hf_ttft_repeats: int = 3,
         max_model_len: int | None = None) -> list[dict]:
    """`llm`: an engine already built for this model (run_all shares one); else one is built.
    `shape`: prompt_len, new_tokens, ttft_prompt_len (default: the protocol, or TINY)."""
    model, dev, dtype = bench_setup(model, device, dtype, tiny)
    shape = dict(shape or (TINY if tiny else FULL))
    id_high = min(10000, vocab_size(model))
    rows: list[dict] = measure_floors(dev) if floors else []
    ours: list[dict] = []
    own = llm is None
    try:
        if own:
            llm = build_engine(model, dev, dtype,
                               max_model_len=max_model_len or (4096 if not tiny else 256),
                               **(engine_kwargs or {}))
        res = glassbox_latency(llm, dev, id_high, repeats=repeats, ttft_repeats=ttft_repeats,
                               **shape)
        log(f"glassbox {model}: {res['decode_tok_s']:,.1f} tok/s, TTFT {res['ttft_ms']:.2f} ms")
        ours = latency_rows(bench, model, "glassbox", res, shape)
        rows += ours
    except Exception as exc:
        rows.append(error_row(bench, model, "glassbox", exc))
    finally:
        if own:
            shutdown_engine(llm)
        llm = None
        free_memory(dev)
    if hf:
        hf_shape = dict(shape, new_tokens=hf_new_tokens or shape["new_tokens"])

        def peer_figures(hf_model) -> list[dict]:
            res = hf_latency(hf_model, dev, id_high, repeats=hf_repeats,
                             ttft_repeats=hf_ttft_repeats, **hf_shape)
            log(f"HF {model}: {res['decode_tok_s']:,.1f} tok/s, TTFT {res['ttft_ms']:.2f} ms")
            peer = latency_rows(bench, model, "hf-generate", res, hf_shape)
            rows.extend(peer)
            return peer
        peer = hf_peer(rows, bench, model, dev, dtype, peer_figures) or []
        rows += compare_rows(bench, model, ours, peer)
    return rows


def cpu_models(tiny: bool) -> list[str]:
    if tiny:
        return ["tiny"]
    models = ["qwen3-0.6b"]
    if (DEMO_DIR / "config.json").exists():
        models.insert(0, "demo")
    else:
        log(f"no demo checkpoint at {DEMO_DIR}: measuring Qwen3-0.6B shapes only")
    return models


def cpu_main(models: list[str] | None = None, dtype=None, hf: bool = True, tiny: bool = False,
             floors: bool = True, threads: int | None = None) -> list[dict]:
    """--cpu: each model on its CPU_SHAPES protocol, rows under the bench "cpu"."""
    threads = threads or cpu_threads()
    torch.set_num_threads(threads)
    log(f"CPU bench with {threads} torch threads")
    dtype = parse_dtype(dtype) or torch.float32
    rows: list[dict] = []
    if floors:
        rows += [dict(r, bench="cpu-floors") for r in measure_floors(resolve_device("cpu"))]
    for model in models or cpu_models(tiny):
        shape = CPU_SHAPES[model]
        ours_rep, hf_rep = CPU_REPEATS[model]
        # twice the longest request, not main's 4096: the demo checkpoint holds 512 positions
        longest = max(shape["prompt_len"] + shape["new_tokens"], shape["ttft_prompt_len"] + 2)
        try:
            rows += main(model, "cpu", dtype, repeats=ours_rep, hf=hf, hf_repeats=hf_rep,
                         floors=False, bench="cpu", shape=shape, ttft_repeats=1,
                         hf_ttft_repeats=1, max_model_len=2 * longest)
        except Exception as exc:
            rows.append(error_row("cpu", model, "-", exc))
    for r in rows:  # the CPU target is stated for 2 cores: say how many this run had
        if r["bench"] == "cpu" and r["metric"] != "error":
            r["note"] = f"{r['note']}, {threads} threads".lstrip(", ")
    return rows


def cli(argv=None) -> list[dict]:
    p = base_parser(__doc__)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--hf-repeats", type=int, default=2)
    p.add_argument("--cpu", action="store_true",
                   help="the CPU bench: --models on the CPU in fp32, each on its own protocol "
                        "and repeats (--model, --device and the repeats above are not used)")
    p.add_argument("--models", default=None,
                   help="--cpu: comma list from demo,qwen3-0.6b,tiny (default: demo if present "
                        "+ 0.6b)")
    p.add_argument("--threads", type=int, default=None,
                   help="--cpu: torch threads (default: all cores)")
    a = p.parse_args(argv)
    if a.cpu:
        models = a.models.split(",") if a.models else None
        unknown = sorted(set(models or ()) - set(CPU_SHAPES))
        if unknown:
            p.error(f"--models: {', '.join(unknown)} unknown; choose from {', '.join(CPU_SHAPES)}")
        rows = cpu_main(models, a.dtype, not a.no_hf, a.tiny, not a.no_floors, a.threads)
        finish_cli(rows, "cpu latency", a.json)
        return rows
    if a.tiny:
        a.repeats, a.hf_repeats = min(a.repeats, 2), 1
    rows = main(a.model, a.device, a.dtype, a.repeats, not a.no_hf, a.hf_repeats, a.tiny,
                not a.no_floors)
    finish_cli(rows, "latency", a.json)
    return rows


if __name__ == "__main__":
    cli()
