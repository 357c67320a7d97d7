"""Speculative decoding at batch 1 (Qwen3-0.6B shapes, dummy weights, 4 speculative tokens):
decode tok/s of plain decoding beside n-gram prompt lookup on random ids (nothing to find: the
cost of looking) and an oracle proposer at controlled acceptance, all in one engine and one run.

Dummy weights give no natural acceptance, so the oracle replays the greedy tokens of a plain run
of the same prompt (every draft right: through the real verify path) and corrupts each draft
token with probability 1 - alpha, alpha chosen so the acceptance rate (vLLM's: accepted /
drafted tokens; a draft after a wrong one is never accepted) is 100 % / 80 % / 50 %, and 0 %:
every draft wrong, where the adaptive back-off must make speculation cost almost nothing. Each
speculative run's tokens are checked against the plain run's (`exact`): speculation must not
change greedy output beyond the rounding of a 1 + k-row step against a 1-row one (bf16 on dummy
weights: see oracle_run, which settles the oracle's reference before timing). Then the
many-request workload (bench/throughput.py's: 256 requests, seeded sampling at temperature
0.6) with n-gram speculation on and off: output tok/s, and the share of requests whose tokens are plain decoding's (seeded: all, up to batch numerics).
Per run: tok/s, the measured acceptance (accepted / drafted draft tokens) and tokens per decode
step (the step cost model: speculation wins when tokens per step beats the verify step's cost
over a plain step's)."""
from __future__ import annotations

import random
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (base_parser, bench_setup, build_engine, error_row, finish_cli,
                          free_memory, log, measure_floors, median, random_prompt, row, sampling,
                          shutdown_engine, vocab_size)

FULL = dict(prompt_len=128, new_tokens=256)
TINY = dict(prompt_len=16, new_tokens=24)
TINY_WORKLOAD = dict(prompt_len=(8, 48), output_len=(4, 16))
K = 4
RATES = (1.0, 0.8, 0.5, 0.0)       # target acceptance rates (accepted / drafted)


def alpha_for(rate: float, k: int = K) -> float:
    """Per-token draft correctness alpha whose expected acceptance rate is `rate`:
    (alpha + alpha^2 + ... + alpha^k) / k = rate (bisection; monotone in alpha)."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if sum(mid ** i for i in range(1, k + 1)) / k < rate:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


class OracleProposer:
    """Drafts the reference continuation (a plain greedy run of the same prompt) from the
    current length on, each token replaced by a wrong one with probability 1 - alpha."""

    def __init__(self, prompt_len: int, reference: list[int], alpha: float, vocab: int,
                 seed: int = 0):
        self.prompt_len, self.reference, self.alpha, self.vocab = (prompt_len, reference, alpha,
                                                                   vocab)
        self.rng = random.Random(seed)

    def __call__(self, token_ids, k: int) -> list[int]:
        at = len(token_ids) - self.prompt_len
        out = []
        for t in self.reference[at:at + k]:
            if self.rng.random() >= self.alpha:
                t = (t + 1 + self.rng.randrange(self.vocab - 1)) % self.vocab   # never t itself
            out.append(t)
        return out


def timed_stream(llm, prompt: list[int], new_tokens: int, k: int) -> dict:
    """One streamed greedy request: decode tok/s over (first token, last token], its tokens,
    and its drafts (TokenEvent.draft)."""
    times, tokens, drafts = [], [], []
    params = sampling(temperature=0.0, ignore_eos=True, max_tokens=new_tokens,
                      num_speculative_tokens=k)
    for ev in llm.stream(prompt, params):
        if ev.token_id is not None:
            times.append(time.perf_counter())
            tokens.append(ev.token_id)
        if ev.draft is not None:
            drafts.append(ev.draft)
    if len(times) < 2:
        raise RuntimeError(f"asked for {new_tokens} tokens, the stream gave {len(times)}")
    drafted = sum(len(d.drafted) for d in drafts)
    accepted = sum(d.num_accepted for d in drafts)
    # decode steps: each verify emitted accepted + 1 tokens; every other token took one step
    from_verify = sum(d.num_accepted + 1 for d in drafts)
    steps = len(drafts) + max(0, len(tokens) - 1 - from_verify)
    return {"tok_s": (len(times) - 1) / (times[-1] - times[0]), "tokens": tokens,
            "acceptance": accepted / drafted if drafted else None,
            "tokens_per_step": (len(tokens) - 1) / steps if steps else None,
            "verifies": len(drafts)}


def oracle_run(llm, prompt, plain_tokens, prompt_len, new_tokens, alpha, vocab, seed,
               max_runs: int = 64) -> dict:
    """A timed oracle run whose drafts are the speculative run's own greedy tokens.

    In bf16 a verify step (1 + k rows) and a plain decode step (1 row) round differently, and on
    dummy weights the top two logits are often closer than that rounding, so the speculative run
    can leave plain decoding's tokens; from there every replayed draft is wrong and the measured
    acceptance falls far below the target. So the reference settles first: run, and replay the
    run's own tokens, until a run gives the tokens it was fed (each run fixes at least the first
    token where the last one left its reference). The settled run is the timed one; `exact`
    reports whether the first run, fed plain decoding's tokens, gave them back."""
    ref, first = plain_tokens, None
    for n in range(1, max_runs + 1):
        llm.core.proposer_for = (lambda seq, r=ref: OracleProposer(prompt_len, r, alpha, vocab,
                                                                   seed=seed))
        try:
            got = timed_stream(llm, prompt, new_tokens, K)
        finally:
            llm.core.proposer_for = None
        if first is None:
            first = got["tokens"] == plain_tokens
        if got["tokens"] == ref:
            return {**got, "exact": first, "settle_runs": n}
        ref = got["tokens"]
    raise RuntimeError(f"the oracle reference did not settle in {max_runs} runs")


def run(llm, id_high: int, vocab: int, prompt_len: int, new_tokens: int, repeats: int,
        bench: str, model: str) -> list[dict]:
    rows: list[dict] = []
    note = f"batch 1, {prompt_len}-tok random prompt, {new_tokens} greedy tokens, k={K}"
    prompts = [random_prompt(prompt_len, id_high, 10 * r) for r in range(repeats)]
    # warm-up: the prefill shapes, the decode graph and the verify chunk's shapes
    warm = random_prompt(prompt_len, id_high, 999)
    ref_warm = timed_stream(llm, warm, 8, 0)["tokens"]
    llm.core.proposer_for = lambda seq: OracleProposer(prompt_len, ref_warm, 1.0, vocab)
    timed_stream(llm, warm, 8, K)
    llm.core.proposer_for = None

    plain = [timed_stream(llm, p, new_tokens, 0) for p in prompts]
    base = median([r["tok_s"] for r in plain])
    log(f"plain: {base:,.1f} tok/s")
    plain_row = row(bench, model, "plain", "decode_tok_s", base, "tok/s", note)
    rows.append(plain_row)

    def report(system: str, runs: list[dict], extra: str = ""):
        tok_s = median([r["tok_s"] for r in runs])
        exact = all(r.get("exact", r["tokens"] == p["tokens"]) for r, p in zip(runs, plain))
        acc = [r["acceptance"] for r in runs if r["acceptance"] is not None]
        tps = [r["tokens_per_step"] for r in runs if r["tokens_per_step"] is not None]
        log(f"{system}: {tok_s:,.1f} tok/s ({tok_s / base:.2f}x), acceptance "
            f"{median(acc) if acc else float('nan'):.2f}, exact {exact}")
        ours = row(bench, model, system, "decode_tok_s", tok_s, "tok/s", note)
        rows.extend([
            ours,
            row(bench, model, system, "acceptance", median(acc) if acc else None, "ratio",
                "accepted / drafted draft tokens" + extra),
            row(bench, model, system, "tokens_per_step", median(tps) if tps else None, "tok",
                "decode tokens per step (plain: 1)"),
            row(bench, model, system, "exact", float(exact), "bool",
                "greedy tokens identical to plain decoding"),
        ])
        rows.append(row(bench, model, system, "speedup", tok_s / base, "x",
                        "decode tok/s over plain decoding's"))

    # n-gram prompt lookup with nothing to find (random ids): the cost of looking, and backing off
    report("ngram-random", [timed_stream(llm, p, new_tokens, K) for p in prompts])
    for rate in RATES:
        alpha = alpha_for(rate)
        runs = [oracle_run(llm, p, plain[i]["tokens"], prompt_len, new_tokens, alpha, vocab, i)
                for i, p in enumerate(prompts)]
        report(f"oracle-{int(rate * 100)}", runs,
               f" (target {rate:.0%}, alpha {alpha:.3f}; oracle reference settled in "
               f"{max(r['settle_runs'] for r in runs)} runs)")
    return rows


def workload(llm, model: str, num_requests: int, tiny: bool, dev, bench: str) -> list[dict]:
    """Many requests at once, speculation off then on (n-gram, K tokens), same seeded params."""
    from bench.common import make_workload, timed
    kw = dict(TINY_WORKLOAD) if tiny else {}
    reqs = make_workload(num_requests, seed=0, id_stream=0, id_high=min(10000, vocab_size(model)),
                         **kw)
    prompts = [r.prompt for r in reqs]
    rows, outs, base = [], {}, None
    note = f"{num_requests} requests (throughput.py's workload), temperature 0.6, seeded"
    for system, k in (("workload-plain", 0), ("workload-ngram", K)):
        params = [sampling(temperature=0.6, seed=i, ignore_eos=True, max_tokens=r.max_tokens,
                           num_speculative_tokens=k) for i, r in enumerate(reqs)]
        got, secs = timed(lambda ps=params: llm.generate(prompts, ps), dev)
        tokens = sum(len(o.token_ids) for o in got)
        outs[system] = got
        tok_s = tokens / secs
        log(f"{system}: {tokens} tokens in {secs:.2f}s = {tok_s:,.0f} tok/s")
        rows.append(row(bench, model, system, "output_tok_s", tok_s, "tok/s", note))
        if base is None:
            base = tok_s
        else:
            drafted = sum(len(v.drafted) for o in got for v in o.drafts)
            accepted = sum(v.num_accepted for o in got for v in o.drafts)
            same = sum(a.token_ids == b.token_ids for a, b in
                       zip(outs["workload-plain"], got)) / len(got)
            rows += [row(bench, model, system, "speedup", tok_s / base, "x",
                         "output tok/s over plain decoding's"),
                     row(bench, model, system, "acceptance",
                         accepted / drafted if drafted else None, "ratio",
                         f"accepted / drafted draft tokens ({drafted} drafted)"),
                     row(bench, model, system, "exact_share", same, "ratio",
                         "requests whose tokens equal plain decoding's")]
    return rows


def draft_cost(target: str, drafter: str, dev, dtype, repeats: int, tiny: bool,
               bench: str) -> list[dict]:
    """A draft model for a larger target, measured with the step cost model: a speculative
    step costs k draft forwards (propose) and one 1 + k-row target forward (verify), so it beats
    plain decoding when its tokens per step exceed step_ms / plain_ms — and with i.i.d. draft
    tokens, tokens per step = 1 + k * acceptance. Dummy weights accept a draft by chance only
    (acceptance ~0: the adaptive back-off is off here so every step drafts), so this measures
    the costs and the acceptance needed to win, not a speedup. The verify alone is the oracle at
    100 % (its drafts cost nothing)."""
    from bench.common import TINY_OF, model_dir
    if tiny:
        target, drafter = TINY_OF.get(target, target), TINY_OF.get(drafter, drafter)
    shape = dict(TINY if tiny else FULL)
    prompt_len, new_tokens = shape["prompt_len"], shape["new_tokens"]
    vocab = vocab_size(target)
    id_high = min(10000, vocab)
    name = f"{target}+{drafter}-draft"
    note = f"batch 1, {prompt_len}-tok random prompt, {new_tokens} greedy tokens, k={K}"
    rows, llm = [], None
    try:
        llm = build_engine(target, dev, dtype, max_model_len=4096 if not tiny else 256,
                           speculative_config=dict(model=str(model_dir(drafter)),
                                                   num_speculative_tokens=K,
                                                   adaptive_min_acceptance=0.0))
        warm = random_prompt(prompt_len, id_high, 999)
        timed_stream(llm, warm, 8, 0)
        timed_stream(llm, warm, 8, K)
        prompts = [random_prompt(prompt_len, id_high, 10 * r) for r in range(repeats)]
        plain = [timed_stream(llm, p, new_tokens, 0) for p in prompts]
        drafted = [timed_stream(llm, p, new_tokens, K) for p in prompts]
        verify = [oracle_run(llm, p, plain[i]["tokens"], prompt_len, new_tokens, 1.0, vocab, i)
                  for i, p in enumerate(prompts)]

        def step_ms(runs):     # ms per decode step = ms per token x tokens per step
            return median([1e3 * (r["tokens_per_step"] or 1.0) / r["tok_s"] for r in runs])

        plain_ms, spec_ms, verify_ms = step_ms(plain), step_ms(drafted), step_ms(verify)
        need = spec_ms / plain_ms
        acc = [r["acceptance"] for r in drafted if r["acceptance"] is not None]
        log(f"{name}: plain {plain_ms:.3f} ms/step, drafted step {spec_ms:.3f} ms (verify "
            f"{verify_ms:.3f}, propose {spec_ms - verify_ms:.3f}); wins above {need:.2f} tokens "
            f"a step = acceptance {(need - 1) / K:.0%}")
        rows += [
            row(bench, name, "plain", "decode_tok_s", median([r["tok_s"] for r in plain]),
                "tok/s", note),
            row(bench, name, "plain", "step_ms", plain_ms, "ms", "a plain decode step"),
            row(bench, name, "draft", "decode_tok_s", median([r["tok_s"] for r in drafted]),
                "tok/s", note + ", the draft's own acceptance"),
            row(bench, name, "draft", "acceptance", median(acc) if acc else None, "ratio",
                "accepted / drafted draft tokens (dummy weights)"),
            row(bench, name, "draft", "step_ms", spec_ms, "ms", "propose (k draft forwards) + "
                "verify"),
            row(bench, name, "draft", "verify_ms", verify_ms, "ms", "the 1 + k-row target step "
                "alone (oracle at 100 %, whose drafts cost nothing)"),
            row(bench, name, "draft", "propose_ms", spec_ms - verify_ms, "ms",
                f"{K} draft forwards"),
            row(bench, name, "draft", "break_even_tokens_per_step", need, "tok",
                "speculation wins above this (step_ms / plain step_ms)"),
            row(bench, name, "draft", "break_even_acceptance", (need - 1) / K, "ratio",
                "the acceptance that gives it: 1 + k * acceptance tokens a step"),
        ]
    except Exception as exc:
        rows.append(error_row(bench, name, "glassbox", exc))
    finally:
        shutdown_engine(llm)
        free_memory(dev)
    return rows


def main(model: str = "qwen3-0.6b", device: str | None = None, dtype=None, repeats: int = 3,
         tiny: bool = False, floors: bool = True, bench: str = "spec_decode",
         engine_kwargs: dict | None = None, num_requests: int | None = 256,
         draft_target: str | None = None) -> list[dict]:
    """num_requests: the many-request workload's size (None or 0: skip it; tiny: 4).
    draft_target: also measure `model` as the draft of this larger target (draft_cost)."""
    model, dev, dtype = bench_setup(model, device, dtype, tiny)
    shape = dict(TINY if tiny else FULL)
    vocab = vocab_size(model)
    id_high = min(10000, vocab)
    rows: list[dict] = measure_floors(dev) if floors else []
    llm = None
    try:
        llm = build_engine(model, dev, dtype, max_model_len=4096 if not tiny else 256,
                           **(engine_kwargs or {}))
        rows += run(llm, id_high, vocab, repeats=repeats, bench=bench, model=model, **shape)
        if num_requests:
            rows += workload(llm, model, 4 if tiny else num_requests, tiny, dev, bench)
    except Exception as exc:
        rows.append(error_row(bench, model, "glassbox", exc))
    finally:
        shutdown_engine(llm)
        free_memory(dev)
    if draft_target:
        rows += draft_cost(draft_target, model, dev, dtype, repeats, tiny, bench)
    return rows


def cli(argv=None) -> list[dict]:
    p = base_parser(__doc__)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--num-requests", type=int, default=256,
                   help="the many-request workload's size (0: skip it)")
    p.add_argument("--draft-target", default="qwen3-8b",
                   help="measure --model as the draft model of this target ('': skip)")
    p.add_argument("--only-draft", action="store_true",
                   help="only the draft-model measurement")
    a = p.parse_args(argv)
    if a.tiny:
        a.repeats = min(a.repeats, 2)
    if a.only_draft:
        model, dev, dtype = bench_setup(a.model, a.device, a.dtype, a.tiny)
        rows = draft_cost(a.draft_target, model, dev, dtype, a.repeats, a.tiny, "spec_decode")
    else:
        rows = main(a.model, a.device, a.dtype, a.repeats, a.tiny, not a.no_floors,
                    num_requests=a.num_requests, draft_target=a.draft_target or None)
    finish_cli(rows, "spec_decode", a.json)
    return rows


if __name__ == "__main__":
    cli()
