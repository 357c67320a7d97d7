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


def watched_run(path, graphs: bool, monkeypatch, batches, watch, **kw):
    """Each batch generated with its first prompt watched by `watch` (the rest unwatched):
    (tokens, traces of the watched requests, prefill steps graphed, every step's expert load)."""
    monkeypatch.setenv("GLASSBOX_PREFILL_GRAPHS", "1" if graphs else "0")
    llm = LLM(path, device="cuda", dtype="float32", num_kv_blocks=512, block_size=16,
              max_num_seqs=8, **kw)
    try:
        sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        ids, traces = [], []
        for batch in batches:
            outs = llm.generate(batch, sp, watch=[watch] + [None] * (len(batch) - 1))
            ids += [o.token_ids for o in outs]
            traces.append(llm.trace(outs[0].request_id))
        steps = llm.inspect().steps
        graphed = [s for s in steps if s.num_prefill_tokens and s.graph_bucket]
        loads = [s.expert_load for s in steps if s.expert_load is not None]
        return ids, traces, graphed, loads
    finally:
        llm.shutdown()


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_a_watched_prefill_replays_a_graph_that_records_what_the_eager_one_does(
        model_factory, monkeypatch, arch):
    """Norms of every prompt token, the last token's lens and attention over its context,
    routing and expert load: a watched prompt's probes from a prefill graph (captured on
    first use) equal the eager prefill's — alone, beside unwatched prompts, and chunked."""
    from engine import ProbeSpec
    path = model_factory(arch)
    batches = [prompts(11, [37]), prompts(12, [20, 90, 5]), prompts(13, [150])]
    kw = dict(max_num_batched_tokens=64)        # the 150-token prompt: three chunks
    ref_ids, ref_tr, none, ref_loads = watched_run(path, False, monkeypatch, batches,
                                                   ProbeSpec(), **kw)
    assert not none
    ids, trs, graphed, loads = watched_run(path, True, monkeypatch, batches, ProbeSpec(), **kw)
    assert ids == ref_ids
    # every prefill step of these batches fits a graph: one watched request each
    assert len(graphed) >= 3, f"only {len(graphed)} watched prefill steps replayed a graph"
    for a, b in zip(trs, ref_tr):
        na, nb = a.norms(), b.norms()
        assert na.shape == nb.shape and na.shape[0] >= len(a.prompt_token_ids)
        np.testing.assert_allclose(na, nb, rtol=1e-3)
        assert len(a.lens) == len(b.lens) and a.lens[0].position == b.lens[0].position
        for x, y in zip(a.lens, b.lens):
            np.testing.assert_array_equal(x.top_ids[:, 0], y.top_ids[:, 0])
            np.testing.assert_allclose(x.top_probs, y.top_probs, atol=1e-4)
        assert len(a.attention) == len(b.attention)
        for x, y in zip(a.attention, b.attention):
            assert x.position == y.position and x.layers == y.layers
            np.testing.assert_allclose(x.probs, y.probs, atol=1e-4)
        ra, rb = a.routing(), b.routing()
        assert (ra is None) == (rb is None)
        if ra is not None:
            np.testing.assert_allclose(ra[0], rb[0], atol=1e-5)
            np.testing.assert_array_equal(ra[1], rb[1])
    # the expert load of every step, padded tokens of a bucket excluded
    assert len(loads) == len(ref_loads)
    for x, y in zip(loads, ref_loads):
        np.testing.assert_array_equal(x, y)


def test_two_watched_prompts_in_one_prefill_step_run_eagerly_and_stay_exact(model_factory,
                                                                            monkeypatch):
    from engine import ProbeSpec
    path = model_factory("qwen3")
    monkeypatch.setenv("GLASSBOX_PREFILL_GRAPHS", "1")
    llm = LLM(path, device="cuda", dtype="float32", num_kv_blocks=256, block_size=16)
    try:
        ps = prompts(14, [30, 41])
        outs = llm.generate(ps, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
                            watch=[ProbeSpec(), ProbeSpec()])
        first = llm.inspect().steps[0]
        assert first.num_prefill_tokens == 71 and first.graph_bucket is None
        for o, p in zip(outs, ps):
            assert llm.trace(o.request_id).norms().shape[0] >= len(p)
    finally:
        llm.shutdown()


def test_a_watched_variant_captured_after_a_longer_prompt_starts_from_harmless_inputs(
        model_factory, monkeypatch):
    """The static inputs hold the last replay's rows (a 300-token prompt samples row 299); a
    probe variant captured next at the 16-token bucket runs its warm-up on them: they must be
    reset first (it was a device-side assert: row 299 of a 16-row hidden state)."""
    from engine import ProbeSpec
    path = model_factory("qwen3")
    monkeypatch.setenv("GLASSBOX_PREFILL_GRAPHS", "1")
    llm = LLM(path, device="cuda", dtype="float32", num_kv_blocks=256, block_size=16)
    try:
        sp = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
        llm.generate(prompts(15, [300]), sp)
        short = prompts(16, [9])[0]
        out = llm.generate([short], sp, watch=ProbeSpec())[0]
        steps = llm.inspect().steps
        pre = [s for s in steps if s.num_prefill_tokens == 9]
        assert pre and pre[-1].graph_bucket == 16
        assert llm.trace(out.request_id).norms().shape[0] >= len(short)
        ref = llm.generate([short], sp)[0]          # the same prompt, unwatched: same tokens
        assert ref.token_ids == out.token_ids
    finally:
        llm.shutdown()
