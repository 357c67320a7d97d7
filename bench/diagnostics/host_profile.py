"""Where the engine thread's host time goes in a batch-1 decode step: plain, watched with every
probe, and watched without attention capture — ms/token of each, then a cProfile of the engine
thread's steps (only that thread: the caller's stream loop is not in it).

    python bench/diagnostics/host_profile.py [--model qwen3-0.6b] [--new-tokens 256] [--top 30]

A diagnostic, not a benchmark: it prints tables, it does not write RESULTS.md.
"""
from __future__ import annotations

import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common import (TINY_OF, base_parser, build_engine, log, random_prompt, resolve_device,
                          sampling, shutdown_engine)


def decode_ms(llm, prompt, new_tokens: int, watch, params=None) -> float:
    times = []
    params = params or sampling(temperature=0.0, ignore_eos=True, max_tokens=new_tokens)
    for ev in llm.stream(prompt, params, watch=watch):
        if ev.token_id is not None:
            times.append(time.perf_counter())
    return 1e3 * (times[-1] - times[0]) / (len(times) - 1)


def profiled_steps(llm, prompt, new_tokens: int, watch, top: int, params=None) -> str:
    """cProfile of EngineCore.step on the engine thread for one request."""
    prof = cProfile.Profile()
    core = llm.core
    plain = core.step

    def step():
        prof.enable()
        try:
            return plain()
        finally:
            prof.disable()
    core.step = step
    try:
        decode_ms(llm, prompt, new_tokens, watch, params)
    finally:
        core.step = plain
    out = io.StringIO()
    st = pstats.Stats(prof, stream=out)
    st.sort_stats("tottime").print_stats(top)
    st.sort_stats("cumulative").print_stats(top)
    return out.getvalue()


def main(argv=None) -> None:
    from engine import ProbeSpec
    p = base_parser(__doc__)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--tokenizer", help="profile a JSON-schema-guided request against a plain "
                   "one instead (sampling_extras' schema), with this tokenizer beside --model's "
                   "shape (tools/make_bpe_tokenizer.py)")
    a = p.parse_args(argv)
    if a.tokenizer:
        return guided_profile(a)
    model = TINY_OF.get(a.model, a.model) if a.tiny else a.model
    dev = resolve_device(a.device)
    llm = build_engine(model, dev, None, max_model_len=4096 if not a.tiny else 256)
    try:
        id_high = 10_000 if not a.tiny else 200
        n = a.new_tokens if not a.tiny else 16
        specs = {"plain": None, "watched (every probe)": ProbeSpec(),
                 "watched, no attention": ProbeSpec(attention=False),
                 "attention only": ProbeSpec(norms=False, logit_lens=False, routing=False)}
        decode_ms(llm, random_prompt(128, id_high, 1), n, ProbeSpec())     # warm every variant
        decode_ms(llm, random_prompt(128, id_high, 2), n, None)
        rows = []
        for name, spec in specs.items():
            ms = sorted(decode_ms(llm, random_prompt(128, id_high, 10 + i), n, spec)
                        for i in range(3))[1]
            rows.append((name, ms))
            log(f"{name}: {ms:.3f} ms/token")
        for name, spec in (("watched (every probe)", ProbeSpec()), ("plain", None)):
            print(f"\n=== cProfile of the engine thread's steps: {name} ===")
            print(profiled_steps(llm, random_prompt(128, id_high, 99), n, spec, a.top))
        print("\n| batch-1 decode | ms/token |\n| --- | --- |")
        for name, ms in rows:
            print(f"| {name} | {ms:.3f} |")
    finally:
        shutdown_engine(llm)


def guided_profile(a) -> None:
    from bench.diagnostics.sampling_extras import SCHEMA, _shape_with_tokenizer
    llm = _shape_with_tokenizer(a.model, a.tokenizer)
    try:
        prompt = llm.tokenizer("Write numbers:").input_ids
        n = a.new_tokens
        params = {"plain": sampling(temperature=0.7, seed=0, ignore_eos=True, max_tokens=n),
                  "guided": sampling(temperature=0.7, seed=0, ignore_eos=True, max_tokens=n,
                                     guided={"json_schema": SCHEMA})}
        for sp in params.values():
            decode_ms(llm, prompt, n, None, sp)
        for name, sp in params.items():
            ms = sorted(decode_ms(llm, prompt, n, None, sp) for _ in range(3))[1]
            steps = [s for s in llm.inspect().steps if not s.num_prefill_tokens][-n // 2:]
            med = lambda xs: 1e3 * sorted(xs)[len(xs) // 2]  # noqa: E731
            log(f"{name}: {ms:.3f} ms/token; per decode step (ms, median): schedule "
                f"{med([s.t_schedule for s in steps]):.3f}, prepare "
                f"{med([s.t_prepare for s in steps]):.3f}, launch "
                f"{med([s.t_launch for s in steps]):.3f}, wait {med([s.t_wait for s in steps]):.3f},"
                f" postprocess {med([s.t_sample for s in steps]):.3f}, GPU "
                f"{med([s.t_forward for s in steps]):.3f}")
        for name, sp in params.items():
            print(f"\n=== cProfile of the engine thread's steps: {name} ===")
            print(profiled_steps(llm, prompt, n, None, a.top, sp))
    finally:
        shutdown_engine(llm)


if __name__ == "__main__":
    main()
