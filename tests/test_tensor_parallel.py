"""Tensor parallelism on the CPU: 2 processes over gloo must reproduce TP=1 exactly."""
from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest

from engine import LLM, ProbeSpec, SamplingParams, WorkerDiedError
from engine.runner import Runner

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [3, 4, 5], [20, 21, 22, 23, 24, 25]]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)


def _run(path, tp, watch=None, **kw):
    llm = LLM(path, num_kv_blocks=48, block_size=4, tensor_parallel_size=tp,
              record_expert_load=True, **kw)
    procs = list(getattr(llm.runner, "procs", []))
    assert isinstance(llm.runner, Runner)
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


@pytest.mark.parametrize("tp", [2, 4])
def test_probes_gather_every_head_to_rank0(model_factory, tp):
    """TP=4 on 4 query / 2 KV heads: each rank holds one query head and a replicated KV head."""
    path = model_factory("qwen3")
    spec = ProbeSpec()
    _, ref, _ = _run(path, 1, spec)
    _, got, snap = _run(path, tp, spec)
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


def test_tp4_greedy_tokens_equal_tp1_on_moe(model_factory):
    path = model_factory("qwen3_moe")
    ref, _, _ = _run(path, 1)
    got, _, snap = _run(path, 4)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert sorted(h for r in snap.tp_layout for h in r.q_heads) == list(range(snap.num_heads))


def test_tp2_overlap_scheduling_equals_serial(model_factory):
    """Every rank samples the same ids, so a step's pending input ids come from each rank's
    own device: the overlapped loop gives the serial loop's tokens at TP=2."""
    path = model_factory("qwen3")
    ref, _, _ = _run(path, 2, async_scheduling=False)
    got, _, _ = _run(path, 2, async_scheduling=True)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]


def test_killed_worker_raises_on_rank0_within_seconds(model_factory):
    path = model_factory("qwen3")
    llm = LLM(path, num_kv_blocks=48, block_size=4, tensor_parallel_size=2)
    shm_name = llm.runner.chan.name
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
    # this engine's own resources only (other processes may use /dev/shm meanwhile)
    if os.path.isdir("/dev/shm"):
        assert shm_name not in os.listdir("/dev/shm"), "the step broadcast ring was left behind"


def test_a_worker_refuses_a_command_outside_the_protocol(model_factory):
    """Sent past the driver's own check, straight into the ring: the worker reports it and
    exits instead of running whatever the name resolves to."""
    llm = LLM(model_factory("qwen3"), num_kv_blocks=48, block_size=4, tensor_parallel_size=2)
    try:
        llm.runner.chan.send(("__init__", ()))
        deadline = time.time() + 30
        with pytest.raises(WorkerDiedError, match="runs only"):
            while time.time() < deadline:
                llm.runner.check_workers()
                time.sleep(0.05)
    finally:
        llm.shutdown()


def test_worker_that_dies_at_start_up_raises_at_once(model_factory, monkeypatch):
    path = model_factory("qwen3")
    from engine.parallel import TPDriver
    from tp_hooks import FailAtStart
    monkeypatch.setattr(TPDriver, "worker_hooks", FailAtStart(rank=1))
    t0 = time.time()
    with pytest.raises(WorkerDiedError, match="start-up failure"):
        LLM(path, num_kv_blocks=48, block_size=4, tensor_parallel_size=2)
    assert time.time() - t0 < 30          # not the 60 s store timeout
    # rank 0's build may still wait in the store for the dead rank: the interpreter must wait
    # for it at exit (a daemon thread back from native code during teardown aborts it)
    builds = [t for t in threading.enumerate() if t.name == "glassbox-tp0-build"]
    assert not any(t.daemon for t in builds)


_ORPHAN_SCRIPT = """
import sys, time
sys.path.insert(0, {root!r})
from engine import LLM
if __name__ == "__main__":
    llm = LLM({path!r}, num_kv_blocks=48, block_size=4, tensor_parallel_size=2)
    print(" ".join(str(p.pid) for p in llm.runner.procs), flush=True)
    time.sleep(600)
"""


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_workers_exit_when_the_main_process_dies(model_factory, tmp_path, sig):
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = tmp_path / "main.py"
    script.write_text(_ORPHAN_SCRIPT.format(root=root, path=model_factory("qwen3")))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(x) for x in proc.stdout.readline().split()]
        assert pids, "the engine did not start"
        os.kill(proc.pid, sig)
        proc.wait(30)

        def alive(pid):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return False
            with open(f"/proc/{pid}/stat") as f:      # a zombie has exited
                return f.read().split()[2] != "Z"
        deadline = time.time() + 20
        while any(alive(p) for p in pids) and time.time() < deadline:
            time.sleep(0.2)
        assert not any(alive(p) for p in pids), "a TP worker outlived its parent"
    finally:
        proc.kill()


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


def test_shutdown_kills_a_worker_that_ignores_terminate(model_factory, monkeypatch):
    from engine.parallel import TPDriver
    from tp_hooks import DeafToShutdown
    monkeypatch.setattr(TPDriver, "worker_hooks", DeafToShutdown(rank=1))
    llm = LLM(model_factory("qwen3"), num_kv_blocks=48, block_size=4, tensor_parallel_size=2)
    procs = list(llm.runner.procs)
    t0 = time.time()
    llm.shutdown()
    assert time.time() - t0 < 20
    assert not any(p.is_alive() for p in procs)
    assert procs[0].exitcode == -signal.SIGKILL
