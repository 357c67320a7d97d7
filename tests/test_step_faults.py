"""A fault at any stage of a step fails the request whose data caused it, or (a fault no
request explains) the requests in that step: never the engine. Each case plants a fault in one
stage (schedule, the probe plan, the intervention plan, the sampling batch, the step inputs,
the launch, the wait for the device, the postprocess, the step's trace) while three healthy
requests run beside a poisoned one; afterwards the engine serves again with the same tokens."""
from __future__ import annotations

import threading

import pytest

from engine import LLM, Intervention, SamplingParams
from engine.errors import RequestFailedError
from test_generate_vs_hf import random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
POISON = 7          # a prompt starting with this id is the poisoned request


def _poisoned(seqs) -> bool:
    return any(s.token_ids and s.token_ids[0] == POISON for s in seqs)


def _run_all(llm, prompts, ids):
    results, errors = {}, {}
    barrier = threading.Barrier(len(prompts))

    def run(i):
        try:
            barrier.wait()
            results[i] = [e.token_id for e in llm.stream(prompts[i], GREEDY, request_id=ids[i])
                          if e.token_id is not None]
        except Exception as e:      # noqa: BLE001
            errors[i] = e
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return results, errors


def _plant(llm, stage: str):
    """Make `stage` raise for any step holding the poisoned request (attributable stages), or
    once (the stages no request's data explains). Returns True for an attributable stage."""
    core = llm.core
    fired = []

    def once() -> bool:
        if fired:
            return False
        fired.append(1)
        return True
    if stage == "probe_plan":
        real = core.probes.plan

        def plan(scheduled):
            if _poisoned([s.seq for s in scheduled]):
                raise IndexError("probe plan (injected)")
            return real(scheduled)
        core.probes.plan = plan
        return True
    if stage == "intervention_plan":
        real = core.interventions.plan

        def iplan(scheduled):
            if _poisoned([s.seq for s in scheduled]):
                raise OverflowError("intervention plan (injected)")
            return real(scheduled)
        core.interventions.plan = iplan
        return True
    if stage == "sampling_batch":
        real = core._banned

        def banned(sampling):
            if _poisoned([s.seq for s in sampling]):
                raise ValueError("sampling batch (injected)")
            return real(sampling)
        core._banned = banned
        return True
    if stage == "launch":
        real = core.runner.execute_step

        def execute_step(inp):
            starts = inp.cu_seqlens_q[:-1]
            if any(inp.input_ids[s] == POISON and inp.positions[s] == 0 for s in starts):
                raise IndexError("launch (injected)")
            return real(inp)
        core.runner.execute_step = execute_step
        return True
    if stage == "postprocess":
        real = core._token_event

        def token_event(seq, tok, lp, now):
            if _poisoned([seq]) and seq.num_output_tokens > 2:
                raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "postprocess (injected)")
            return real(seq, tok, lp, now)
        core._token_event = token_event
        return True
    # the stages no one request explains: they fire once, mid-run
    if stage == "schedule":
        real = core.scheduler.schedule

        def schedule():
            if core.step_id > 3 and once():
                raise RuntimeError("schedule (injected)")
            return real()
        core.scheduler.schedule = schedule
    elif stage == "wait":
        real = core.runner.execute_step

        def execute_step(inp):
            out = real(inp)
            if inp.step_id > 3 and once():
                def wait(*a, **kw):
                    raise RuntimeError("device wait (injected)")
                out.wait = wait
            return out
        core.runner.execute_step = execute_step
    elif stage == "trace":
        real = core._record

        def record(*a, **kw):
            if core.step_id > 3 and once():
                raise KeyError("trace (injected)")
            return real(*a, **kw)
        core._record = record
    else:
        raise AssertionError(stage)
    return False


ATTRIBUTABLE = ["probe_plan", "intervention_plan", "sampling_batch", "launch", "postprocess"]
UNATTRIBUTED = ["schedule", "wait", "trace"]


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("stage", ATTRIBUTABLE + UNATTRIBUTED)
def test_a_fault_at_any_stage_of_a_step_never_ends_the_engine(qwen3_dir, stage, overlap):
    healthy = random_prompts([6, 11, 9], seed=71)
    healthy = [[t if t != POISON else POISON + 1 for t in p] for p in healthy]
    bad = [POISON] + random_prompts([8], seed=72)[0]
    with LLM(qwen3_dir, device="cpu", block_size=4, async_scheduling=overlap) as llm:
        alone = [llm.generate(p, GREEDY)[0].token_ids for p in healthy]
        if stage == "intervention_plan":      # the planner runs only for intervened requests
            llm.core.interventions.add(_Live())
        attributable = _plant(llm, stage)
        results, errors = _run_all(llm, healthy + [bad], ["h0", "h1", "h2", "bad"])
        if attributable:
            assert set(errors) == {3}, errors
            assert isinstance(errors[3], RequestFailedError) and "injected" in str(errors[3])
            for i in range(3):
                assert results[i] == alone[i]
        else:       # the step's requests failed (or finished before it); no other error kind
            assert errors, "the injected fault failed nobody"
            assert all(isinstance(e, RequestFailedError) for e in errors.values()), errors
            for i, toks in results.items():
                if i < 3:
                    assert toks == alone[i]
        assert llm.stats()["alive"]
        snap = llm.inspect()
        assert not snap.running and not snap.waiting
        with llm.loop.lock:
            llm.block_manager.check_invariants([])
        # and the engine still serves, with the tokens it gave before
        assert llm.generate(healthy[1], GREEDY)[0].token_ids == alone[1]


class _Live:
    """A stand-in live intervened request: keeps the planner's `active` true."""
    interventions = (Intervention.ablate_heads(0, [0]),)
    is_finished = False


def test_steps_that_keep_failing_end_the_engine_with_the_reason(qwen3_dir):
    """A fault no request explains, every step (a broken device): after a few steps in a row the
    engine says it failed, instead of failing every request forever."""
    from engine.errors import EngineFailedError
    from engine.engine_loop import MAX_STEP_FAILURES
    with LLM(qwen3_dir, device="cpu", block_size=4) as llm:
        def schedule():
            raise RuntimeError("the device is gone (injected)")
        llm.core.scheduler.schedule = schedule
        for _ in range(MAX_STEP_FAILURES - 1):
            with pytest.raises(RequestFailedError):
                llm.generate([1, 2, 3], GREEDY)
        with pytest.raises(EngineFailedError, match="device is gone"):
            llm.generate([1, 2, 3], GREEDY)
        assert not llm.stats()["alive"]


def test_a_clamp_position_past_any_context_is_refused_and_nobody_fails(qwen3_dir):
    """Issue #48.1: clamp_attention at position 2**63 overflowed int64 on the engine thread and
    ended the engine for everyone. Now it is refused where the request is made, naming the
    field; positions past max_model_len are refused too; the engine serves on."""
    with pytest.raises(ValueError, match="positions"):
        Intervention.clamp_attention(0, [0], [2 ** 63])
    with pytest.raises(ValueError, match="positions"):
        Intervention.from_dict({"kind": "clamp_attention", "layer": 0, "heads": [0],
                                "positions": [9223372036854775808]})
    with LLM(qwen3_dir, device="cpu", block_size=4, max_model_len=64) as llm:
        far = Intervention.clamp_attention(0, [0], [64])
        with pytest.raises(ValueError, match="max_model_len=64"):
            llm.generate([1, 2, 3], GREEDY, interventions=[far])
        ok = Intervention.clamp_attention(0, [0], [0, 63])
        assert len(llm.generate([1, 2, 3], GREEDY, interventions=[ok])[0].token_ids) == 10
        assert llm.stats()["alive"]
