"""Tensor parallelism on the CPU: 2 processes over gloo must reproduce TP=1 exactly."""
from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest

from engine import LLM, ProbeSpec, SamplingParams, WorkerDiedError

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [3, 4, 5], [20, 21, 22, 23, 24, 25]]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)


def _run(path, tp, watch=None):
    llm = LLM(path, num_kv_blocks=48, block_size=4, tensor_parallel_size=tp)
    procs = list(getattr(llm.runner, "procs", []))
    llm.probes.record_expert_load = True
    try:
        outs = llm.generate(PROMPTS, GREEDY, watch=[watch, None, None])
        trace = llm.trace(outs[0].request_id) if watch else None
        return outs, trace, llm.inspect()
    finally:
        llm.shutdown()
        assert not any(p.is_alive() for p in procs), "a TP worker outlived shutdown"


@pytest.mark.parametrize("arch,overrides", [
    ("qwen3", dict(num_key_value_heads=1, vocab_size=511)),   # KV head replicated, odd vocab
    ("qwen2", {}),                                             # q/k/v bias
    ("qwen3_moe", {}),
    ("qwen2_moe", {}),                                         # shared expert + dense layer
])
def test_tp2_greedy_tokens_equal_tp1(model_factory, arch, overrides):
    path = model_factory(arch, **overrides)
    ref, _, _ = _run(path, 1)
    got, _, snap = _run(path, 2)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    for a, b in zip(got, ref):
        np.testing.assert_allclose([x.logprob for x in a.logprobs],
                                   [x.logprob for x in b.logprobs], atol=1e-4)
    assert snap.tp_size == 2 and len(snap.tp_layout) == 2
    heads = sorted(h for r in snap.tp_layout for h in r.q_heads)
    assert heads == list(range(snap.num_heads))
    if snap.moe:                    # the expert load of the last step reaches rank 0's trace
        last = snap.steps[-1]
        tokens = last.num_prefill_tokens + last.num_decode_tokens
        np.testing.assert_array_equal(last.expert_load.sum(1), tokens * snap.moe["top_k"])


def test_probes_gather_every_head_to_rank0(model_factory):
    path = model_factory("qwen3")
    spec = ProbeSpec()
    _, ref, _ = _run(path, 1, spec)
    _, got, snap = _run(path, 2, spec)
    assert snap.steps[-1].collectives > 0
    np.testing.assert_allclose(got.norms(), ref.norms(), rtol=1e-4)
    assert len(got.attention) == len(ref.attention)
    for a, b in zip(got.attention, ref.attention):
        assert a.probs.shape == b.probs.shape          # all heads, not one rank's half
        np.testing.assert_allclose(a.probs, b.probs, atol=1e-5)
    for a, b in zip(got.lens, ref.lens):
        np.testing.assert_array_equal(a.top_ids, b.top_ids)


def test_two_tp_engines_run_at_once(model_factory):
    path = model_factory("qwen3")
    ref, _, _ = _run(path, 1)
    results = {}

    def worker(i):
        results[i] = _run(path, 2)[0]
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    for i in range(2):
        assert [o.token_ids for o in results[i]] == [o.token_ids for o in ref]


def test_killed_worker_raises_on_rank0_within_seconds(model_factory):
    path = model_factory("qwen3")
    shm_before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    llm = LLM(path, num_kv_blocks=48, block_size=4, tensor_parallel_size=2)
    try:
        llm.generate([PROMPTS[0]], GREEDY)          # healthy first
        procs = list(llm.runner.procs)
        pid = procs[0].pid
        os.kill(pid, signal.SIGKILL)
        llm.runner.procs[0].join(timeout=10)
        t0 = time.time()
        with pytest.raises(RuntimeError) as info:
            llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
        assert time.time() - t0 < 15
        assert isinstance(info.value.__cause__, WorkerDiedError)
        assert "rank 1" in str(info.value)
    finally:
        llm.shutdown()
    assert not any(p.is_alive() for p in procs)
    if os.path.isdir("/dev/shm"):
        assert set(os.listdir("/dev/shm")) - shm_before == set(), "shared memory left behind"


def test_tp_group_binding_is_per_thread():
    """Two engines built at once on two threads each bind their own group (no shared global)."""
    from engine.parallel_state import TPGroup, get_tp, use_tp
    barrier, seen = threading.Barrier(2), {}

    def build(rank):
        with use_tp(TPGroup(rank=rank, size=2)):
            barrier.wait()                  # both inside their block at the same time
            seen[rank] = get_tp().rank
            barrier.wait()
    threads = [threading.Thread(target=build, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert seen == {0: 0, 1: 1}
    assert get_tp().size == 1               # outside any block: a single rank
