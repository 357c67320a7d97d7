"""One bad request never hurts another: a request whose own data makes a step fail is failed
alone (its caller gets the error) while concurrent requests finish with the tokens they get
alone; shutdown fails in-flight callers at once; a shut-down engine frees its memory."""
from __future__ import annotations

import gc
import threading
import time
import weakref

import pytest

from engine import LLM, SamplingParams
from engine.errors import EngineShutdownError, RequestFailedError
from test_generate_vs_hf import random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
POISON = 7          # a prompt starting with this id makes the step that computes it raise


def _poison_forward(llm):
    """Make any step whose batch holds a poisoned prompt raise (a stand-in for a request
    whose data breaks a kernel), as an exception from inside the runner would."""
    real = llm.runner.execute_step

    def execute_step(inp):
        starts = inp.cu_seqlens_q[:-1]
        if any(inp.input_ids[s] == POISON and inp.positions[s] == 0 for s in starts):
            raise IndexError("index out of range in a kernel (injected)")
        return real(inp)
    llm.runner.execute_step = execute_step


def _concurrent(llm, prompts, params, ids):
    results, errors = {}, {}
    barrier = threading.Barrier(len(prompts))

    def run(i):
        try:
            barrier.wait()
            results[i] = [e for e in llm.stream(prompts[i], params, request_id=ids[i])]
        except Exception as e:      # noqa: BLE001
            errors[i] = e
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return results, errors


@pytest.mark.parametrize("overlap", [False, True])
def test_a_failing_request_among_three_healthy_streams_fails_alone(qwen3_dir, overlap):
    healthy = random_prompts([6, 11, 9], seed=31)
    healthy = [[t if t != POISON else POISON + 1 for t in p] for p in healthy]
    bad = [POISON] + random_prompts([8], seed=32)[0]
    with LLM(qwen3_dir, device="cpu", block_size=4, async_scheduling=overlap) as llm:
        alone = [llm.generate(p, GREEDY)[0].token_ids for p in healthy]
        _poison_forward(llm)
        prompts = healthy + [bad]
        results, errors = _concurrent(llm, prompts, GREEDY, ["h0", "h1", "h2", "bad"])
        assert set(errors) == {3}, errors
        assert isinstance(errors[3], RequestFailedError)
        assert "injected" in str(errors[3])
        for i in range(3):
            assert [e.token_id for e in results[i] if e.token_id is not None] == alone[i]
            assert results[i][-1].finish_reason == "length"
        snap = llm.inspect()
        assert not snap.block_tables and not snap.running and not snap.waiting
        with llm.loop.lock:
            llm.block_manager.check_invariants([])
        # and the engine still serves
        assert llm.generate(healthy[0], GREEDY)[0].token_ids == alone[0]


def test_a_failure_in_one_requests_postprocessing_stays_with_it(qwen3_dir):
    prompts = random_prompts([5, 7, 9], seed=33)
    with LLM(qwen3_dir, device="cpu", block_size=4) as llm:
        alone = [llm.generate(p, GREEDY)[0].token_ids for p in prompts]
        real = llm.core._token_event

        def token_event(seq, tok, lp, now):
            if seq.request_id == "broken" and seq.num_output_tokens > 3:
                raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
            return real(seq, tok, lp, now)
        llm.core._token_event = token_event
        results, errors = _concurrent(llm, prompts, GREEDY, ["a", "broken", "c"])
        assert set(errors) == {1} and isinstance(errors[1], RequestFailedError)
        for i in (0, 2):
            assert [e.token_id for e in results[i] if e.token_id is not None] == alone[i]
        assert not llm.inspect().block_tables


def test_shutdown_fails_in_flight_streams_at_once(qwen3_dir):
    llm = LLM(qwen3_dir, device="cpu", block_size=4)
    long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    got: dict = {}
    streaming = [threading.Event() for _ in range(3)]     # set at a stream's first token

    def consume(i):
        try:
            for _ in llm.stream(random_prompts([5], seed=40 + i)[0], long):
                streaming[i].set()
            got[i] = "finished"
        except Exception as e:      # noqa: BLE001
            got[i] = e
        finally:
            streaming[i].set()      # an early failure must not leave the test waiting
    threads = [threading.Thread(target=consume, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    assert all(ev.wait(120) for ev in streaming), "a stream never produced a token"
    assert not got, f"a stream ended before the shutdown: {got}"
    t0 = time.time()
    llm.shutdown()
    for t in threads:
        t.join(10)
    assert time.time() - t0 < 10
    assert all(isinstance(got.get(i), EngineShutdownError) for i in range(3)), got
    with pytest.raises(EngineShutdownError):
        llm.generate([1, 2, 3], GREEDY)


def test_shutdown_releases_the_engine(qwen3_dir):
    """After shutdown nothing keeps the weights or the KV cache alive: the engine's tensors are
    collected even while the LLM object itself is still referenced."""
    llm = LLM(qwen3_dir, device="cpu", block_size=4)
    llm.generate(random_prompts([6], seed=50), GREEDY)
    kv = weakref.ref(llm.runner.kv_cache)
    weight = weakref.ref(next(llm.runner.model.parameters()))
    thread = llm.loop._thread
    llm.shutdown()
    gc.collect()
    assert kv() is None and weight() is None
    assert not thread.is_alive()
    ref = weakref.ref(llm)
    del llm
    gc.collect()
    assert ref() is None


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS")) / 1024


def test_engines_shut_down_mid_burst_do_not_accumulate(qwen3_dir):
    """Build an engine, fire a burst of streams, shut it down mid-burst, repeat: the streams end
    at once, their threads exit, and neither memory nor threads grow from cycle to cycle (the
    app's model switch does exactly this)."""
    threads0 = threading.active_count()
    rss = []
    for cycle in range(4):
        llm = LLM(qwen3_dir, device="cpu", block_size=4)
        ended = []
        streaming = [threading.Event() for _ in range(6)]     # set at a stream's first token

        def consume(i, llm=llm, streaming=streaming):
            try:
                for _ in llm.stream(random_prompts([9], seed=60 + i)[0],
                                    SamplingParams(temperature=0.8, max_tokens=400,
                                                   ignore_eos=True)):
                    streaming[i].set()
            except EngineShutdownError:
                ended.append(i)
            finally:
                streaming[i].set()
        burst = [threading.Thread(target=consume, args=(i,)) for i in range(6)]
        for t in burst:
            t.start()
        assert all(ev.wait(120) for ev in streaming), "a stream never produced a token"
        ref = weakref.ref(llm)
        llm.shutdown()
        for t in burst:
            t.join(10)
        assert sorted(ended) == list(range(6))
        del llm, consume, burst, streaming
        gc.collect()
        assert ref() is None, "something still holds the shut-down engine"
        rss.append(_rss_mb())
    assert threading.active_count() <= threads0 + 1
    assert rss[-1] - rss[1] < 60, f"RSS grew by cycle: {rss}"
