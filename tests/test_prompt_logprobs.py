"""Prompt logprobs computed by the engine in the prefill equal HF's log_softmax of the full
forward (fp32, tiny random Qwen): chunked prefill, batches mixed with requests that did not
ask, preemption (recomputed), and the prefix cache bypassed for the requests that ask."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams

ATOL = 1e-4


def hf_prompt_logprobs(path: str, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, vocab]: row i is log p(. | prompt[:i + 1])."""
    from tiny_models import load_hf
    hf = load_hf(path)
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[:-1]


def assert_matches_hf(out, prompt: list[int], ref: torch.Tensor, k: int) -> None:
    got = out.prompt_logprobs
    assert got is not None and len(got) == len(prompt) and got[0] is None
    for i in range(1, len(prompt)):
        lp = got[i]
        row = ref[i - 1]
        assert lp.token_id == prompt[i]
        torch.testing.assert_close(torch.tensor(lp.logprob), row[prompt[i]], atol=ATOL, rtol=0)
        assert lp.rank == int((row > row[prompt[i]]).sum()) + 1
        want_ids = row.topk(k).indices.tolist() if k else []
        assert len(lp.top) == k
        for tid in want_ids:          # the same top-k (values compared: ties may reorder ids)
            torch.testing.assert_close(torch.tensor(lp.top.get(tid, float("nan"))), row[tid],
                                       atol=ATOL, rtol=0)


def _prompts(n_list, seed, vocab=512):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in n_list]


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_prompt_logprobs_equal_hf_in_a_mixed_batch(model_factory, arch):
    path = model_factory(arch)
    prompts = _prompts([5, 23, 40], seed=11)
    params = [SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3),
              SamplingParams(temperature=0, max_tokens=2),                  # did not ask
              SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0)]
    with LLM(path, device="cpu", block_size=8, num_kv_blocks=64) as llm:
        outs = llm.generate(prompts, params)
    assert outs[1].prompt_logprobs is None
    assert_matches_hf(outs[0], prompts[0], hf_prompt_logprobs(path, prompts[0]), 3)
    assert_matches_hf(outs[2], prompts[2], hf_prompt_logprobs(path, prompts[2]), 0)


def test_prompt_logprobs_survive_chunked_prefill_and_a_cached_prefix(model_factory):
    path = model_factory("qwen3")
    prompt = _prompts([70], seed=5)[0]
    ref = hf_prompt_logprobs(path, prompt)
    with LLM(path, device="cpu", block_size=8, num_kv_blocks=64,
             max_num_batched_tokens=16) as llm:        # the prompt takes 5 prefill chunks
        plain = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1))[0]
        hits = llm.inspect().prefix_hits
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1,
                                                     prompt_logprobs=2))[0]
        assert llm.inspect().prefix_hits == hits, "a prompt-logprobs request used the cache"
    assert plain.prompt_logprobs is None
    assert_matches_hf(out, prompt, ref, 2)


def test_prompt_logprobs_survive_preemption(model_factory):
    path = model_factory("qwen3")
    prompts = _prompts([30, 30, 30], seed=9)
    p = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, prompt_logprobs=1)
    with LLM(path, device="cpu", block_size=4, num_kv_blocks=24) as llm:
        outs = llm.generate(prompts, p)
        assert llm.inspect().preemptions > 0, "the cache was large enough: no preemption tested"
    for o, pr in zip(outs, prompts):
        assert_matches_hf(o, pr, hf_prompt_logprobs(path, pr), 1)


def test_prompt_logprobs_must_be_a_small_count():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)
