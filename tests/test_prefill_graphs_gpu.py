"""Prefill CUDA graphs (engine/prefill_graphs.py) give the eager prefill's tokens and logprobs:
plain prompts, several in one step, a prefix-cache hit (context longer than the chunk), chunked
prefills, mixed steps with decode rows (pending ids from the device), and the eager fallback
past MAX_SEQS sequences; every architecture, bf16 and fp32."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from engine.prefill_graphs import MAX_SEQS

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


def prompts(seed: int, lens) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 500, (n,), generator=g).tolist() for n in lens]


def run(path, graphs: bool, monkeypatch, batches, dtype="float32", **kw):
    monkeypatch.setenv("GLASSBOX_PREFILL_GRAPHS", "1" if graphs else "0")
    llm = LLM(path, device="cuda", dtype=dtype, num_kv_blocks=512, block_size=16,
              max_num_seqs=8, **kw)
    try:
        sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
        outs = []
        for batch in batches:           # one generate per batch: each batch's prompts prefill together
            outs += llm.generate(batch, sp)
        steps = llm.inspect().steps
        prefill_graphed = [s for s in steps if s.num_prefill_tokens and s.graph_bucket]
        return ([o.token_ids for o in outs], [[x.logprob for x in o.logprobs] for o in outs],
                prefill_graphed, llm.runner.prefill_graphs)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "qwen3_moe"])
def test_graphed_prefill_equals_eager(model_factory, monkeypatch, arch):
    path = model_factory(arch)
    shared = prompts(1, [70])[0]
    batches = [prompts(2, [37]),                         # one prompt (a chat turn)
               prompts(3, [5, 90, 17]),                  # three in one step
               [shared + p for p in prompts(4, [9, 21])],   # prefix-cache hits (second one)
               prompts(5, [3] * (MAX_SEQS + 2))]         # past MAX_SEQS: eager
    ref_ids, ref_lp, none, pg = run(path, False, monkeypatch, batches)
    assert pg is None and not none
    ids, lp, graphed, pg = run(path, True, monkeypatch, batches)
    assert pg is not None and graphed, "no prefill step replayed a graph"
    assert ids == ref_ids
    for a, b in zip(lp, ref_lp):
        np.testing.assert_allclose(a, b, atol=2e-3)


def test_graphed_chunked_and_mixed_steps_equal_eager_bf16(model_factory, monkeypatch):
    # 48 tokens a step: long prompts prefill in chunks, next to the decode rows of the others
    # (mixed steps whose decode rows read their input ids from the device)
    path = model_factory("qwen3")
    batches = [prompts(7, [150, 6, 40])]
    kw = dict(max_num_batched_tokens=48, dtype="bfloat16")
    ref_ids, ref_lp, _, _ = run(path, False, monkeypatch, batches, **kw)
    ids, lp, graphed, _ = run(path, True, monkeypatch, batches, **kw)
    assert any(s.num_decode_tokens for s in graphed), "no mixed step replayed a graph"
    assert ids == ref_ids
    for a, b in zip(lp, ref_lp):
        np.testing.assert_allclose(a, b, atol=0.05)


def test_graphed_prefill_bf16_logprobs_close_to_hf(model_factory, monkeypatch):
    from tiny_models import load_hf
    path = model_factory("qwen3")
    p = prompts(9, [300])[0]
    monkeypatch.setenv("GLASSBOX_PREFILL_GRAPHS", "1")
    llm = LLM(path, device="cuda", dtype="bfloat16", num_kv_blocks=128, block_size=16)
    out = llm.generate([p], SamplingParams(temperature=0, max_tokens=1, logprobs=1,
                                           ignore_eos=True))[0]
    assert llm.inspect().steps[-1].graph_bucket == 512
    llm.shutdown()
    hf = load_hf(path).to("cuda", torch.bfloat16)
    with torch.no_grad():
        lp = torch.log_softmax(hf(torch.tensor([p], device="cuda")).logits[0, -1].float(), -1)
    assert abs(out.logprobs[0].logprob - lp[out.token_ids[0]].item()) < 0.08
