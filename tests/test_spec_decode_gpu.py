"""Speculative decoding on a GPU: the verify step through CUDA graphs (prefill graphs hold its
1 + k sampled rows), overlap scheduling on (the default there), bf16 and fp32: greedy and seeded
sampling give plain decoding's tokens, and the verify steps replay a graph."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}


def _prompts(n: int) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(3, 190, size=5 + i).tolist() * 4 + [int(rng.integers(3, 190))]
            for i in range(n)]


def _run(path, spec, dtype, params, prompts):
    llm = LLM(path, device="cuda", dtype=dtype, num_kv_blocks=256, block_size=16,
              max_num_seqs=8, speculative_config=spec)
    try:
        outs = llm.generate(prompts, params)
        steps = llm.inspect().steps
        with llm.loop.lock:
            llm.block_manager.check_invariants(llm.scheduler.all_sequences())
            assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks
        return outs, steps
    finally:
        llm.shutdown()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("batch", [1, 3])
def test_gpu_speculation_equals_plain(model_factory, dtype, batch):
    path = model_factory("qwen3")
    prompts = _prompts(batch)
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=5, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=1.0, top_p=0.9, top_k=20, seed=9, max_tokens=40,
                             ignore_eos=True)][:batch]
    a, _ = _run(path, None, dtype, params, prompts)
    b, steps = _run(path, NGRAM, dtype, params, prompts)
    for x, y in zip(a, b):
        assert y.token_ids == x.token_ids
    assert any(o.drafts for o in b)
    verify = [s for s in steps if s.num_draft_tokens]
    assert verify and any(s.graph_bucket for s in verify), "no verify step replayed a graph"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_a_draft_model_gives_the_plain_tokens_and_its_decode_rounds_replay_graphs(dtype):
    """The dense demo drafts for the MoE demo on the GPU: greedy and seeded output equal plain
    decoding's, and the draft's one-token rounds replay its own decode graphs."""
    from pathlib import Path
    assets = Path(__file__).resolve().parents[1] / "assets"
    target, draft = str(assets / "demo-qwen3-moe"), str(assets / "demo-qwen3")
    chats = [[{"role": "user", "content": c}] for c in
             ("Copy: glass box glass box", "Sort: 42 7 19 3 11 5", "Reverse: c a t s d o g")]
    params = [SamplingParams(temperature=0, max_tokens=40),
              SamplingParams(temperature=0.8, seed=5, max_tokens=40),
              SamplingParams(temperature=0, max_tokens=40, num_speculative_tokens=2)]
    a, _ = _run(target, None, dtype, params, chats)
    llm = LLM(target, device="cuda", dtype=dtype, num_kv_blocks=256, block_size=16,
              max_num_seqs=8, speculative_config={"model": draft, "num_speculative_tokens": 4})
    buckets = []
    execute = llm.draft.runner.execute_step

    def spy(inp):
        out = execute(inp)
        buckets.append(out.graph_bucket)
        return out
    llm.draft.runner.execute_step = spy
    try:
        b = llm.generate(chats, params)
        with llm.loop.lock:
            llm.draft.check_invariants()
            assert llm.draft.block_manager.num_free_blocks == llm.draft.block_manager.num_blocks
    finally:
        llm.shutdown()
    for x, y in zip(a, b):
        assert y.token_ids == x.token_ids
    assert sum(v.num_accepted for o in b for v in o.drafts) > 0
    assert any(bk is not None for bk in buckets), "no draft round replayed a graph"
