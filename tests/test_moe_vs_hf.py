"""Qwen3-MoE and Qwen2-MoE (shared expert, a dense layer in mlp_only_layers): greedy tokens and
top logprobs equal HF transformers `generate` under batching, chunked prefill, prefix-cache
hits and preemption."""
from __future__ import annotations

import pytest

from engine import LLM
from test_generate_vs_hf import (PROMPT_LENS, assert_same_as_hf, greedy_params, hf_greedy,
                                 random_prompts)


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen2_moe"])
def moe(request, model_factory):
    path = model_factory(request.param)
    prompts = random_prompts(PROMPT_LENS, seed=4321)
    return path, prompts, hf_greedy(path, prompts)


def test_moe_batch_of_prompts_matches_hf(moe):
    path, prompts, refs = moe
    with LLM(path, device="cpu") as llm:
        outs = llm.generate(prompts, greedy_params())
        snap = llm.inspect()
    assert snap.moe is not None and snap.moe["moe_layers"]
    assert len(snap.steps[0].entries) == len(prompts), "the prompts were not batched together"
    assert_same_as_hf(outs, refs)


def test_moe_chunked_prefill_matches_hf(moe):
    path, prompts, refs = moe
    with LLM(path, device="cpu", block_size=4, max_num_batched_tokens=8) as llm:
        outs = llm.generate(prompts, greedy_params())
        steps = llm.inspect().steps
    assert any(e.kind == "prefill" and e.start_pos > 0 for s in steps for e in s.entries)
    assert_same_as_hf(outs, refs)


def test_moe_prefix_cache_hit_reproduces_the_outputs(moe):
    path, prompts, refs = moe
    with LLM(path, device="cpu", block_size=4) as llm:
        first = llm.generate(prompts, greedy_params())
        hits_before = llm.inspect().prefix_hits
        second = llm.generate(prompts, greedy_params())
        hits_after = llm.inspect().prefix_hits
    assert hits_after - hits_before == sum((n - 1) // 4 for n in PROMPT_LENS)
    assert_same_as_hf(first, refs)
    assert_same_as_hf(second, refs)


def test_moe_preemption_recomputes_to_the_same_tokens(moe):
    path, prompts, refs = moe
    with LLM(path, device="cpu", block_size=4, num_kv_blocks=12) as llm:
        outs = llm.generate(prompts, greedy_params())
        snap = llm.inspect()
    assert snap.preemptions > 0
    assert_same_as_hf(outs, refs)
