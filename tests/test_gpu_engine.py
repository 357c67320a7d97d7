"""End to end on the GPU: Triton kernels + CUDA graphs give the CPU path's tokens."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engine import LLM, ProbeSpec, SamplingParams

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [3, 4, 5],
           list(range(30, 70))]


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "qwen3_moe"])
def test_fp32_gpu_greedy_equals_cpu_for_64_tokens(model_factory, arch):
    path = model_factory(arch)
    sp = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    cpu = LLM(path, device="cpu", num_kv_blocks=128, block_size=16)
    ref = [o.token_ids for o in cpu.generate(PROMPTS, sp)]
    cpu.shutdown()
    for eager in (False, True):
        gpu = LLM(path, device="cuda", dtype="float32", num_kv_blocks=128, block_size=16,
                  max_num_seqs=8, enforce_eager=eager)
        got = [o.token_ids for o in gpu.generate(PROMPTS, sp)]
        buckets = {s.graph_bucket for s in gpu.inspect().steps}
        gpu.shutdown()
        assert got == ref, f"eager={eager}"
        if not eager:
            assert buckets - {None}, "decode steps should replay CUDA graphs"


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_context_bounded_decode_graphs_give_the_eager_tokens(model_factory, arch):
    """Small buckets replay graphs captured for a bounded context (fewer attention splits) while
    the longest context fits, then the unbounded one: a 200-token prompt decoded for 400 tokens
    crosses the 256 and 512 bounds, at batch 1 and 2 (rows of different lengths), and gives the
    eager engine's tokens and logprobs."""
    path = model_factory(arch, max_position_embeddings=2048)
    g = np.random.default_rng(7)
    prompts = [[int(t) for t in g.integers(3, 200, 200)], [int(t) for t in g.integers(3, 200, 90)]]
    sp = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True, logprobs=1)
    results = {}
    for eager in (True, False):
        llm = LLM(path, device="cuda", dtype="float32", num_kv_blocks=256, block_size=16,
                  max_num_seqs=4, max_model_len=1024, enforce_eager=eager)
        seen = []
        if not eager:
            graphs = llm.runner.graphs
            assert graphs.caps[1] == [256, 512] and graphs.caps[2], graphs.caps
            pick = graphs.cap
            graphs.cap = lambda bs, lens: seen.append((bs, pick(bs, lens))) or seen[-1][1]
        outs = [llm.generate([p], sp)[0] for p in prompts[:1]] + [llm.generate(prompts, sp)]
        llm.shutdown()
        results[eager] = ([outs[0].token_ids] + [o.token_ids for o in outs[1]],
                          [x.logprob for x in outs[0].logprobs])
        if not eager:
            assert {(1, 256), (1, 512), (1, None), (2, 256), (2, 512)} <= set(seen), sorted(set(seen))
    assert results[False][0] == results[True][0]
    np.testing.assert_allclose(results[False][1], results[True][1], atol=1e-4)


@pytest.mark.parametrize("block_size", [16, 32])
def test_bf16_logprobs_close_to_hf(model_factory, block_size):
    from tiny_models import load_hf
    path = model_factory("qwen3")
    hf = load_hf(path).to("cuda", torch.bfloat16)
    llm = LLM(path, device="cuda", dtype="bfloat16", num_kv_blocks=64, block_size=block_size)
    out = llm.generate([PROMPTS[2]], SamplingParams(temperature=0, max_tokens=8,
                                                    ignore_eos=True, logprobs=1))[0]
    llm.shutdown()
    ids = torch.tensor([PROMPTS[2] + out.token_ids], device="cuda")
    with torch.no_grad():
        logits = hf(ids).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    n = len(PROMPTS[2])
    ref = [lp[n - 1 + i, t].item() for i, t in enumerate(out.token_ids)]
    np.testing.assert_allclose([x.logprob for x in out.logprobs], ref, atol=0.08)


SPECS = {
    "all": ProbeSpec(),
    "norms+routing": ProbeSpec(logit_lens=False, attention=False),
    "attention-subset": ProbeSpec(norms=False, logit_lens=False, routing=False, layers=(1,)),
}


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
@pytest.mark.parametrize("spec", list(SPECS))
def test_graph_probes_equal_eager_probes(model_factory, arch, spec):
    """Each probe-capturing graph variant (captured on first use) records what the eager
    forward records: norms from the norm kernels' sums, routing from the router's own
    buffers, attention for all layers in one launch pair, the lens."""
    path = model_factory(arch)
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    traces, loads = [], []
    for eager in (False, True):
        llm = LLM(path, device="cuda", dtype="float32", num_kv_blocks=64, block_size=16,
                  max_num_seqs=4, enforce_eager=eager)
        outs = llm.generate(PROMPTS, sp, watch=[SPECS[spec], None, None])
        traces.append((outs[0].token_ids, llm.trace(outs[0].request_id)))
        steps = llm.inspect().steps
        assert any(st.graph_bucket is not None for st in steps) != eager
        loads.append([st.expert_load for st in steps if st.expert_load is not None])
        llm.shutdown()
    (ta, a), (tb, b) = traces
    assert ta == tb
    np.testing.assert_allclose(a.norms(), b.norms(), rtol=1e-3)
    assert len(a.attention) == len(b.attention)
    for x, y in zip(a.attention, b.attention):
        assert x.layers == y.layers
        np.testing.assert_allclose(x.probs, y.probs, atol=1e-4)
    assert len(a.lens) == len(b.lens)
    for x, y in zip(a.lens, b.lens):
        np.testing.assert_array_equal(x.top_ids[:, 0], y.top_ids[:, 0])
    # expert load of every step (graph padding rows excluded) is the same either way
    assert len(loads[0]) == len(loads[1])
    for x, y in zip(*loads):
        np.testing.assert_array_equal(x, y)
    ra, rb = a.routing(), b.routing()
    assert (ra is None) == (rb is None)
    if ra is not None:
        np.testing.assert_allclose(ra[0], rb[0], atol=1e-5)
        np.testing.assert_array_equal(ra[1], rb[1])


@pytest.mark.parametrize("arch", ["qwen3", "qwen2"])
def test_fused_qk_norm_rope_store_gives_the_unfused_tokens_and_logprobs(model_factory, monkeypatch, arch):
    """fp32, CUDA graphs and eager: the one-launch q/k norm + RoPE + K/V store gives the tokens
    of the four launches it replaced, logprobs within fp32 rounding (its q/k-norm sum of squares
    adds in another order; qwen2: bias, no q/k norm, exactly equal)."""
    from engine.models import qwen
    path = model_factory(arch)
    sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=3)
    runs = {}
    for fused in (True, False):
        monkeypatch.setattr(qwen, "fused_qkv_path", (lambda qkv: qkv.is_cuda) if fused
                            else (lambda qkv: False))
        for eager in (False, True):
            llm = LLM(path, device="cuda", dtype="float32", num_kv_blocks=128, block_size=16,
                      max_num_seqs=8, enforce_eager=eager)
            outs = llm.generate(PROMPTS, sp)
            llm.shutdown()
            runs[fused, eager] = [(o.token_ids, [(lp.logprob, dict(lp.top)) for lp in o.logprobs])
                                  for o in outs]
    for eager in (False, True):
        a, b = runs[True, eager], runs[False, eager]
        assert [x[0] for x in a] == [x[0] for x in b], f"eager={eager}"
        for (_, la), (_, lb) in zip(a, b):
            np.testing.assert_allclose([x[0] for x in la], [x[0] for x in lb], atol=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_overlap_scheduling_equals_serial_on_the_gpu(model_factory, dtype):
    """CUDA graphs + overlap (the GPU default): pending input ids come from the device, host
    copies run one step late; tokens, logprobs, finish reasons and probes are the serial loop's."""
    path = model_factory("qwen3")
    prompts = PROMPTS + [list(range(100, 133)), [7, 8]]
    eos = [o for o in (2,)]
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.8, seed=5, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=1.0, top_p=0.9, seed=6, max_tokens=25, ignore_eos=True),
              SamplingParams(temperature=0.9, seed=7, max_tokens=30, min_tokens=5,
                             stop_token_ids=eos),
              SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[9, 10, 11])]
    runs = []
    for overlap in (False, True):
        llm = LLM(path, device="cuda", dtype=dtype, num_kv_blocks=128, block_size=16,
                  max_num_seqs=8, async_scheduling=overlap)
        outs = llm.generate(prompts, params, watch=[ProbeSpec(), None, None, None, None])
        tr = llm.trace(outs[0].request_id)
        snap = llm.inspect()
        llm.shutdown()
        assert not snap.block_tables
        runs.append((outs, tr))
    (a, ta), (b, tb) = runs
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids and x.finish_reason == y.finish_reason
        assert [lp.logprob for lp in x.logprobs] == [lp.logprob for lp in y.logprobs]
    np.testing.assert_array_equal(ta.norms(), tb.norms())
    for x, y in zip(ta.attention, tb.attention):
        np.testing.assert_array_equal(x.probs, y.probs)


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "qwen3_moe"])
def test_batch1_fused_norm_gemvs_give_the_cpu_tokens_norms_and_logprobs(model_factory, arch):
    """One request at a time, so every decode step runs the batch-1 path: input / post-attention
    RMSNorm inside the QKV / gate_up GEMMs (norm_linear.py), under PDL, from CUDA graphs and
    eagerly. fp32 against the CPU engine (the unfused torch ops): the same tokens,
    logprobs within fp32 rounding, and the residual norms the fused kernels' sums give the probes."""
    path = model_factory(arch)
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    spec = ProbeSpec(logit_lens=False, attention=False)

    def run(**kw):
        llm = LLM(path, num_kv_blocks=128, block_size=16, **kw)
        got = []
        for p in PROMPTS:
            o = llm.generate([p], sp, watch=[spec])[0]
            got.append((o.token_ids, [lp.logprob for lp in o.logprobs],
                        llm.trace(o.request_id).norms()))
        llm.shutdown()
        return got

    ref = run(device="cpu")
    for eager in (False, True):
        got = run(device="cuda", dtype="float32", max_num_seqs=4, enforce_eager=eager)
        for (t, lp, nm), (rt, rlp, rnm) in zip(got, ref):
            assert t == rt, f"eager={eager}"
            np.testing.assert_allclose(lp, rlp, atol=1e-4)
            np.testing.assert_allclose(nm, rnm, rtol=1e-4)
