"""Scheduler as a specification: per-step token budget and max_num_seqs, chunked prefill next to
decode, preemption of the youngest request, FIFO admission, max_model_len; driven directly with
a fake model (any token) and through LLM (inspect().steps)."""
from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import LLM, SamplingParams
from engine.block_manager import BlockManager
from engine.scheduler import Scheduler
from engine.sequence import Sequence
from test_generate_vs_hf import random_prompts

_ids = itertools.count()


def make_seqs(lens: list[int], max_tokens: int | list[int]) -> list[Sequence]:
    mts = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(lens)
    return [Sequence(f"r{next(_ids)}", list(range(1, n + 1)),
                     SamplingParams(max_tokens=m, ignore_eos=True), 0) for n, m in zip(lens, mts)]


def run(sched: Scheduler, seqs: list[Sequence], max_steps: int = 10_000):
    """Step a scheduler to completion with a fake model; return each step's (seq, n, start)."""
    for s in seqs:
        sched.add(s)
    steps = []
    while sched.has_work():
        assert len(steps) < max_steps, "no progress"
        out = sched.schedule()
        assert out, "a step with work scheduled nothing"
        for e in out:   # each entry continues where its sequence stopped, inside the sequence
            assert e.start == e.seq.num_computed_tokens
            assert 1 <= e.num_tokens and e.start + e.num_tokens <= len(e.seq)
            assert len(e.seq.block_table) * sched.bm.block_size >= e.start + e.num_tokens
        steps.append([(e.seq, e.num_tokens, e.start) for e in out])
        sched.postprocess(out, [7] * sum(e.samples for e in out))
        sched.bm.check_invariants(sched.all_sequences())
    return steps


@settings(max_examples=60, deadline=None, database=None)
@given(lens=st.lists(st.integers(1, 20), min_size=1, max_size=6),
       max_tokens=st.integers(1, 6), budget=st.integers(1, 20), max_seqs=st.integers(1, 4),
       bs=st.integers(1, 4), spare_blocks=st.integers(0, 12))
def test_every_step_respects_the_token_budget_and_max_num_seqs(lens, max_tokens, budget,
                                                               max_seqs, bs, spare_blocks):
    longest = max(lens) + max_tokens
    num_blocks = (longest + bs - 1) // bs + spare_blocks      # always room for one request
    bm = BlockManager(num_blocks, bs)
    sched = Scheduler(bm, max_seqs, budget, num_blocks * bs, set())
    seqs = make_seqs(lens, max_tokens)
    steps = run(sched, seqs)
    for step in steps:
        assert sum(n for _, n, _ in step) <= budget
        assert len(step) <= max_seqs
        assert len({id(s) for s, _, _ in step}) == len(step), "a request twice in one step"
    for s in seqs:
        assert s.finish_reason == "length" and s.num_output_tokens == max_tokens
    assert bm.num_free_blocks == num_blocks, "blocks leaked"


def test_chunked_prefill_runs_in_the_same_step_as_decode():
    bm = BlockManager(64, 4)
    sched = Scheduler(bm, 8, 6, 256, set())
    a, b = make_seqs([3, 30], [4, 2])
    steps = run(sched, [a, b])
    got = [[(s.request_id, n, start) for s, n, start in step] for step in steps[:3]]
    # step 1 fills the budget with a's prompt and b's first chunk; then a decodes one token
    # per step while b's prompt keeps arriving in chunks of the remaining budget
    assert got == [[(a.request_id, 3, 0), (b.request_id, 3, 0)],
                   [(a.request_id, 1, 3), (b.request_id, 5, 3)],
                   [(a.request_id, 1, 4), (b.request_id, 5, 8)]]


def test_the_youngest_running_request_is_preempted_when_the_cache_is_full():
    bm = BlockManager(4, 2)                      # 8 slots
    sched = Scheduler(bm, 8, 64, 8, set())
    old, young = make_seqs([3, 3], 4)            # each grows to 7 tokens = 4 blocks
    run(sched, [old, young])
    assert old.num_preemptions == 0 and young.num_preemptions >= 1
    assert sched.num_preemptions == young.num_preemptions
    assert old.num_output_tokens == young.num_output_tokens == 4


def test_waiting_requests_are_admitted_in_arrival_order():
    bm = BlockManager(64, 4)
    sched = Scheduler(bm, 1, 64, 256, set())
    seqs = make_seqs([5, 2, 9, 1], 2)
    steps = run(sched, seqs)
    first_seen = []
    for step in steps:
        for s, _, _ in step:
            if s.request_id not in first_seen:
                first_seen.append(s.request_id)
    assert first_seen == [s.request_id for s in seqs]


# ---- through the engine ----------------------------------------------------------------------

def test_engine_steps_respect_the_token_budget_and_max_num_seqs(qwen3_dir):
    prompts = random_prompts([3, 14, 5, 9, 21, 2, 11], seed=31)
    with LLM(qwen3_dir, device="cpu", block_size=4, max_num_batched_tokens=10,
             max_num_seqs=3) as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=5,
                                                    ignore_eos=True))
        steps = llm.inspect().steps
    assert all(len(o.token_ids) == 5 for o in outs)
    assert steps and all(sum(e.num_tokens for e in s.entries) <= 10 for s in steps)
    assert all(len(s.entries) <= 3 and s.num_running <= 3 for s in steps)
    assert sum(s.num_prefill_tokens for s in steps) >= sum(map(len, prompts))


def test_engine_mixes_a_prefill_chunk_and_decodes_in_one_step(qwen3_dir):
    short, long = random_prompts([3, 40], seed=32)
    with LLM(qwen3_dir, device="cpu", block_size=4, max_num_batched_tokens=8) as llm:
        llm.generate([short, long], SamplingParams(temperature=0, max_tokens=6,
                                                   ignore_eos=True))
        steps = llm.inspect().steps
    mixed = [s for s in steps if {e.kind for e in s.entries} == {"prefill", "decode"}]
    assert mixed, "no step held both a prefill chunk and a decode"
    for s in mixed:
        assert s.num_prefill_tokens + s.num_decode_tokens == sum(e.num_tokens for e in s.entries)
        assert all(e.num_tokens == 1 for e in s.entries if e.kind == "decode")


@pytest.mark.parametrize("prompt_len", [20, 23])
def test_max_model_len_ends_the_request_with_length(qwen3_dir, prompt_len):
    prompt = random_prompts([prompt_len], seed=33)[0]
    with LLM(qwen3_dir, device="cpu", block_size=4, max_model_len=24) as llm:
        o = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=50,
                                                ignore_eos=True))[0]
    assert o.finish_reason == "length"
    assert len(o.prompt_token_ids) + len(o.token_ids) == 24
