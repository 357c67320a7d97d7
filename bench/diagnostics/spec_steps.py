"""Where a speculative step's time goes, at batch 1: the engine's own step traces of a plain run,
an oracle run at 100 % acceptance, one at 50 % and prompt lookup on the same random prompt, each
split into schedule (propose inside it), prepare, launch, device time, wait and postprocess, and
the wall time per step, for verify steps and plain steps apart.

    python bench/diagnostics/spec_steps.py [--model qwen3-0.6b] [--tiny]

The question it answers: a verify step emits up to 1 + k tokens but costs more than a plain
step (no overlap scheduling: the drafts continue the newest token, which must be on the host;
1 + k rows through a prefill graph) — which part of it, and how much of that is the host's.
"""
from __future__ import annotations

import statistics
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common import base_parser, bench_setup, build_engine, random_prompt, vocab_size
from bench.spec_decode import FULL, K, TINY, alpha_for, oracle_run, timed_stream

PHASES = ("t_schedule", "t_propose", "t_prepare", "t_launch", "t_forward", "t_wait", "t_sample")


def split(llm, run) -> tuple[dict, list[str]]:
    """run() under the step traces: (its result, one line per kind of step)."""
    _, cursor = llm.steps_since(0)
    result = run()
    steps, _ = llm.steps_since(cursor)
    decode = [s for s in steps if s.num_prefill_tokens == 0 or s.verifies][1:]
    lines = []
    for kind, ss in (("verify", [s for s in decode if s.verifies]),
                     ("plain", [s for s in decode if not s.verifies])):
        if not ss:
            continue
        walls = [b.wall_time - a.wall_time for a, b in zip(ss, ss[1:])]
        ms = {p: 1e3 * statistics.median(getattr(s, p) for s in ss) for p in PHASES}
        lines.append(
            f"  {kind:6s} {len(ss):4d} steps, wall {1e3 * statistics.median(walls) if walls else 0:.3f}"
            f" ms/step | " + " ".join(f"{p[2:]} {v:.3f}" for p, v in ms.items()) +
            f" | graph {statistics.mode(s.graph_bucket for s in ss)}, overlapped "
            f"{sum(s.overlapped for s in ss)}/{len(ss)}")
    return result, lines


def main(argv=None) -> None:
    p = base_parser(__doc__)
    a = p.parse_args(argv)
    model, dev, dtype = bench_setup(a.model, a.device, a.dtype, a.tiny)
    shape = TINY if a.tiny else FULL
    P, N = shape["prompt_len"], shape["new_tokens"]
    vocab = vocab_size(model)
    llm = build_engine(model, dev, dtype, max_model_len=4096 if not a.tiny else 256)
    try:
        id_high = min(10000, vocab)
        timed_stream(llm, random_prompt(P, id_high, 999), 8, 0)     # warm-up
        prompt = random_prompt(P, id_high, 5)
        runs = [("plain", lambda: timed_stream(llm, prompt, N, 0))]
        plain, lines = split(llm, runs[0][1])
        print(f"plain: {plain['tok_s']:,.0f} tok/s")
        print("\n".join(lines))
        for name, run in (
                ("oracle-100", lambda: oracle_run(llm, prompt, plain["tokens"], P, N, 1.0, vocab, 0)),
                ("oracle-50", lambda: oracle_run(llm, prompt, plain["tokens"], P, N,
                                                 alpha_for(0.5), vocab, 0)),
                ("ngram", lambda: timed_stream(llm, prompt, N, K))):
            r, lines = split(llm, run)
            print(f"{name}: {r['tok_s']:,.0f} tok/s, acceptance {r['acceptance']}, "
                  f"{r['tokens_per_step']:.2f} tokens a step, {r['verifies']} verifies")
            print("\n".join(lines))
    finally:
        llm.shutdown()


if __name__ == "__main__":
    main()
