"""Overlap scheduling (step N+1 scheduled and launched before step N is postprocessed) gives
exactly what the serial loop gives: tokens, logprobs, texts, finish reasons, probes — across
sampling, stop rules, min_tokens, preemption, prefix-cache hits, chunked prefill and aborts —
and returns every block it allocated."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from engine import LLM, ProbeSpec, SamplingParams
from test_generate_vs_hf import random_prompts


def _engine(path, overlap: bool, **kw) -> LLM:
    kw.setdefault("block_size", 4)
    return LLM(path, device="cpu", async_scheduling=overlap, **kw)


def _run(path, prompts, params, overlap, watch=None, **kw):
    with _engine(path, overlap, **kw) as llm:
        outs = llm.generate(prompts, params, watch=watch)
        traces = [llm.trace(o.request_id) if (watch and watch[i]) else None
                  for i, o in enumerate(outs)]
        snap = llm.inspect()
        with llm.loop.lock:
            llm.block_manager.check_invariants(llm.scheduler.all_sequences())
        assert not snap.block_tables and not snap.running, "a request kept its blocks"
        steps = len(snap.steps)
    return outs, traces, steps


def _same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids
        assert x.finish_reason == y.finish_reason
        assert x.text == y.text
        assert len(x.logprobs) == len(y.logprobs)
        np.testing.assert_allclose([lp.logprob for lp in x.logprobs],
                                   [lp.logprob for lp in y.logprobs], atol=1e-6)
        for i, (p, q) in enumerate(zip(x.logprobs, y.logprobs)):
            # the same top-k alternatives with the same logprobs, not only as many of them
            assert sorted(p.top) == sorted(q.top), (x.request_id, i, p.top, q.top)
            np.testing.assert_allclose([p.top[t] for t in sorted(p.top)],
                                       [q.top[t] for t in sorted(p.top)], atol=1e-6)


def test_overlap_equals_serial_greedy_and_seeded_sampling(qwen3_dir):
    prompts = random_prompts([3, 9, 17, 25], seed=5)
    params = [SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.9, seed=11, max_tokens=9, ignore_eos=True),
              SamplingParams(temperature=1.2, top_k=20, top_p=0.9, seed=3, max_tokens=12,
                             ignore_eos=True, logprobs=1),
              SamplingParams(temperature=0.7, min_p=0.05, seed=8, max_tokens=7, ignore_eos=True)]
    ser, _, _ = _run(qwen3_dir, prompts, params, overlap=False)
    ovl, _, _ = _run(qwen3_dir, prompts, params, overlap=True)
    _same(ser, ovl)


def test_overlap_equals_serial_with_stops_and_min_tokens(qwen3_dir):
    """EOS, stop ids and stop strings are seen one step late under overlap: the extra token
    already in flight is dropped, never delivered."""
    prompts = random_prompts([5, 8, 11, 14, 6], seed=6)
    with _engine(qwen3_dir, False) as llm:       # what the model says, to pick stops from
        free = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12,
                                                    ignore_eos=True))
    stop_id = free[1].token_ids[4]
    stop_text = free[2].text[3:6] or free[2].text[:2]
    eos = sorted(llm.eos_token_ids)[0]
    params = [SamplingParams(temperature=0, max_tokens=12),
              SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_id]),
              SamplingParams(temperature=0, max_tokens=12, stop=[stop_text]),
              SamplingParams(temperature=0, max_tokens=12, min_tokens=6,
                             stop_token_ids=[free[3].token_ids[2]]),
              SamplingParams(temperature=1.0, seed=4, max_tokens=12, min_tokens=3,
                             stop_token_ids=[eos])]
    ser, _, _ = _run(qwen3_dir, prompts, params, overlap=False)
    ovl, _, _ = _run(qwen3_dir, prompts, params, overlap=True)
    _same(ser, ovl)
    assert ser[1].finish_reason == "stop" and ser[1].token_ids[-1] == stop_id
    assert ser[2].finish_reason == "stop" and stop_text not in ser[2].text
    assert len(ser[3].token_ids) >= 6


def test_overlap_equals_serial_under_preemption_and_prefix_hits(qwen3_dir):
    shared = random_prompts([12], seed=7)[0]
    prompts = [shared + p for p in random_prompts([3, 5, 7, 9, 2, 6], seed=8)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    # a cache too small for all six at full length: preemption; the shared prefix: hits
    kw = dict(num_kv_blocks=18, max_num_batched_tokens=16)
    ser, _, _ = _run(qwen3_dir, prompts, params, overlap=False, **kw)
    ovl, _, _ = _run(qwen3_dir, prompts, params, overlap=True, **kw)
    _same(ser, ovl)
    assert any(o.metrics["preemptions"] for o in ovl), "the workload did not preempt"
    assert any(o.metrics["prefix_cached_blocks"] for o in ovl), "no prefix-cache hit"


def test_overlap_probes_equal_serial_probes(qwen3_dir):
    prompts = random_prompts([6, 13, 9], seed=9)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    watch = [ProbeSpec(prefill_pattern_layers=(0, 1)), None, ProbeSpec(layers=(2,))]
    _, ts, _ = _run(qwen3_dir, prompts, params, overlap=False, watch=watch)
    _, to, _ = _run(qwen3_dir, prompts, params, overlap=True, watch=watch)
    for a, b in ((ts[0], to[0]), (ts[2], to[2])):
        np.testing.assert_allclose(a.norms(), b.norms(), rtol=1e-6)
        assert [s.position for s in a.lens] == [s.position for s in b.lens]
        for x, y in zip(a.lens, b.lens):
            np.testing.assert_array_equal(x.top_ids, y.top_ids)
            np.testing.assert_array_equal(x.sampled_rank, y.sampled_rank)
        assert len(a.attention) == len(b.attention) == 8
        for x, y in zip(a.attention, b.attention):
            np.testing.assert_allclose(x.probs, y.probs, atol=1e-7)
        for layer in a.prefill_pattern:
            np.testing.assert_allclose(a.prefill_pattern[layer], b.prefill_pattern[layer])
        assert a.output_token_ids == b.output_token_ids


def test_overlap_abort_mid_stream_frees_blocks_and_others_finish(qwen3_dir):
    prompts = random_prompts([7, 10, 4], seed=10)
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    short = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    with _engine(qwen3_dir, False) as llm:
        ref = llm.generate(prompts[1:], short)
    with _engine(qwen3_dir, True) as llm:
        got: dict = {}

        def consume(i):
            got[i] = [e for e in llm.stream(prompts[i], short)]
        threads = [threading.Thread(target=consume, args=(i,)) for i in (1, 2)]
        stream = llm.stream(prompts[0], long, request_id="victim")
        first = next(stream)
        for t in threads:
            t.start()
        llm.abort("victim")
        rest = list(stream)
        for t in threads:
            t.join(60)
        assert first.token_id is not None
        assert rest[-1].finished and rest[-1].finish_reason == "abort"
        for i, o in zip((1, 2), ref):
            assert [e.token_id for e in got[i] if e.token_id is not None] == o.token_ids
        snap = llm.inspect()
        assert "victim" not in snap.block_tables
        with llm.loop.lock:
            llm.block_manager.check_invariants(llm.scheduler.all_sequences())


@pytest.mark.parametrize("overlap", [False, True])
def test_a_finished_requests_extra_slot_is_returned(qwen3_dir, overlap):
    """Block accounting stays exact: after each of many short requests the free count is back
    where it started (the decode row still in flight when EOS is seen included)."""
    with _engine(qwen3_dir, overlap, num_kv_blocks=40) as llm:
        free0 = llm.inspect().num_free_blocks
        eos = sorted(llm.eos_token_ids)
        for i, p in enumerate(random_prompts([3, 4, 5, 6, 7, 8], seed=20 + overlap)):
            llm.generate(p, SamplingParams(temperature=1.0, seed=i, max_tokens=9,
                                           stop_token_ids=eos))
            snap = llm.inspect()
            assert snap.num_free_blocks == free0
            assert all(b.ref_count == 0 for b in snap.blocks)
