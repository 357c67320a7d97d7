"""Greedy tokens and top logprobs equal HF transformers `generate` on tiny Qwen2 / Qwen3
checkpoints, whatever the engine does underneath: batching, block sizes, chunked prefill,
preemption, prefix-cache hits, tied embeddings, rope_parameters, sharded checkpoints.

The helpers here (random_prompts, hf_greedy, greedy_params, assert_same_as_hf) are reused by
test_moe_vs_hf.py."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from engine import LLM, SamplingParams

PROMPT_LENS = [3, 6, 10, 16, 19, 32]     # 7 divides none of them; 16 fills one block exactly
NUM_NEW = 10
TOP_K = 5
ATOL = 1e-4

_HF_CACHE: dict = {}


def random_prompts(lens: list[int], seed: int, vocab: int = 512) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


def hf_greedy(path: str, prompts: list[list[int]], n: int = NUM_NEW):
    """HF eager fp32 greedy generate, EOS ignored: [(new token ids, log_softmax [n, vocab])]."""
    from tiny_models import load_hf
    out = []
    hf = None
    for p in prompts:
        key = (path, tuple(p), n)
        if key not in _HF_CACHE:
            if hf is None:
                hf = load_hf(path)
                hf.generation_config.eos_token_id = None     # like ignore_eos=True
            with torch.no_grad():
                ids = torch.tensor([p])     # an explicit mask: a token 0 is not padding
                r = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                                output_logits=True, return_dict_in_generate=True, pad_token_id=0)
            toks = r.sequences[0, len(p):].tolist()
            assert len(toks) == n, "HF stopped early: it did not ignore EOS"
            _HF_CACHE[key] = (toks, torch.log_softmax(torch.cat(r.logits).float(), dim=-1))
        out.append(_HF_CACHE[key])
    return out


def greedy_params(n: int = NUM_NEW, k: int = TOP_K) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=k)


def assert_same_as_hf(outs, refs, k: int = TOP_K, atol: float = ATOL) -> None:
    assert len(outs) == len(refs)
    for j, (o, (toks, lp)) in enumerate(zip(outs, refs)):
        assert o.token_ids == toks, f"prompt {j}: tokens differ from HF"
        assert o.finish_reason == "length"
        assert len(o.logprobs) == len(toks)
        for i, tl in enumerate(o.logprobs):
            assert tl.token_id == toks[i]
            assert abs(tl.logprob - lp[i, toks[i]].item()) <= atol, f"prompt {j} token {i}"
            assert len(tl.top) == k
            ids = torch.tensor(list(tl.top))
            ours = torch.tensor(list(tl.top.values()))
            # the values are HF's top-k (in order), and each id carries HF's logprob
            torch.testing.assert_close(ours, lp[i].topk(k).values, atol=atol, rtol=0)
            torch.testing.assert_close(ours, lp[i, ids], atol=atol, rtol=0)


@pytest.fixture(scope="module", params=["qwen2", "qwen3"])
def dense(request, model_factory):
    """(checkpoint dir, six prompts of different lengths, HF references) per architecture."""
    path = model_factory(request.param)
    prompts = random_prompts(PROMPT_LENS, seed=1234)
    return path, prompts, hf_greedy(path, prompts)


def test_single_request_matches_hf_tokens_and_top_logprobs(dense):
    path, prompts, refs = dense
    with LLM(path, device="cpu") as llm:
        outs = llm.generate(prompts[4], greedy_params())
    assert_same_as_hf(outs, refs[4:5])


def test_batch_of_prompts_with_different_lengths_matches_hf(dense):
    path, prompts, refs = dense
    with LLM(path, device="cpu") as llm:
        outs = llm.generate(prompts, greedy_params())
        first = llm.inspect().steps[0]
    assert len(first.entries) == len(prompts), "the prompts were not batched together"
    assert_same_as_hf(outs, refs)


@pytest.mark.parametrize("block_size", [1, 7, 16])
def test_outputs_match_hf_for_any_block_size(dense, block_size):
    path, prompts, refs = dense
    assert block_size != 7 or all(n % 7 for n in PROMPT_LENS), "7 must divide no prompt"
    with LLM(path, device="cpu", block_size=block_size) as llm:
        outs = llm.generate(prompts, greedy_params())
    assert_same_as_hf(outs, refs)


def test_chunked_prefill_matches_hf(dense):
    path, prompts, refs = dense
    budget = 8
    assert budget < max(PROMPT_LENS)
    with LLM(path, device="cpu", block_size=4, max_num_batched_tokens=budget) as llm:
        outs = llm.generate(prompts, greedy_params())
        steps = llm.inspect().steps
    assert any(e.kind == "prefill" and e.start_pos > 0 for s in steps for e in s.entries), \
        "no prompt was split into chunks"
    assert_same_as_hf(outs, refs)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preemption_recomputes_to_the_same_tokens(dense, prefix_caching):
    path, prompts, refs = dense
    # 12 blocks of 4 hold one longest request (32 + 10 tokens) but not the whole batch
    with LLM(path, device="cpu", block_size=4, num_kv_blocks=12,
             enable_prefix_caching=prefix_caching) as llm:
        outs = llm.generate(prompts, greedy_params())
        snap = llm.inspect()
    assert snap.preemptions > 0
    assert snap.num_free_blocks == snap.num_blocks
    assert_same_as_hf(outs, refs)


def test_prefix_cache_hit_reproduces_the_outputs(dense):
    path, prompts, refs = dense
    bs = 4
    with LLM(path, device="cpu", block_size=bs) as llm:
        first = llm.generate(prompts, greedy_params())
        hits_before = llm.inspect().prefix_hits
        second = llm.generate(prompts, greedy_params())
        hits_after = llm.inspect().prefix_hits
    assert hits_before == 0
    # every full prompt block except one holding the last token is served from the cache
    assert hits_after - hits_before == sum((n - 1) // bs for n in PROMPT_LENS)
    assert all(o.metrics["prefix_cached_blocks"] == (n - 1) // bs
               for o, n in zip(second, PROMPT_LENS))
    assert_same_as_hf(first, refs)
    assert_same_as_hf(second, refs)


@pytest.mark.parametrize("tied", [True, False])
def test_tied_and_untied_embeddings_match_hf(model_factory, tied):
    from safetensors import safe_open
    path = model_factory("qwen3", tie_word_embeddings=tied)
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        assert ("lm_head.weight" in f.keys()) != tied
    prompts = random_prompts([5, 13], seed=7)
    with LLM(path, device="cpu") as llm:
        outs = llm.generate(prompts, greedy_params())
    assert_same_as_hf(outs, hf_greedy(path, prompts))


def test_rope_theta_inside_rope_parameters_is_honoured(model_factory):
    path = model_factory("qwen2", rope_theta=500.0)
    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    assert "rope_theta" not in raw, "this transformers keeps rope_theta at the top level"
    assert raw["rope_parameters"]["rope_theta"] == 500.0
    prompts = random_prompts([24], seed=8)
    with LLM(path, device="cpu") as llm:
        outs = llm.generate(prompts, greedy_params())
    assert_same_as_hf(outs, hf_greedy(path, prompts))


def test_sharded_checkpoint_loads_and_matches_hf(model_factory, tmp_path):
    from safetensors.torch import load_file, save_file
    src = model_factory("qwen3")
    dst = tmp_path / "sharded"
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    os.remove(dst / "model.safetensors")
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file, part in shards.items():
        save_file({n: tensors[n].contiguous() for n in part}, str(dst / file),
                  metadata={"format": "pt"})
        weight_map.update({n: file for n in part})
    with open(dst / "model.safetensors.index.json", "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    prompts = random_prompts([11], seed=9)
    with LLM(str(dst), device="cpu") as llm:
        outs = llm.generate(prompts, greedy_params())
    assert_same_as_hf(outs, hf_greedy(src, prompts))      # reference: the unsharded original
