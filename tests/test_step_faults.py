"""A fault at any stage of a step fails the request whose data caused it, or (a fault no
request explains) the requests in that step: never the engine. Each case plants a fault in one
stage (schedule, the probe plan, the intervention plan, the sampling batch, the step inputs,
the launch, the wait for the device, the postprocess, the step's trace) while three healthy
requests run beside a poisoned one; afterwards the engine serves again with the same tokens."""
from __future__ import annotations

import pytest

from engine import LLM, Intervention, SamplingParams
from engine.errors import RequestFailedError
from engine.sequence import Sequence
from test_generate_vs_hf import random_prompts
from test_isolation import POISON, _concurrent, _poison_forward

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def _poisoned(seqs) -> bool:
    return any(s.token_ids and s.token_ids[0] == POISON for s in seqs)


def _wrap(owner, name: str, fault):
    """Replace owner.name with a call that first runs fault(*args) (which may raise)."""
    real = getattr(owner, name)

    def call(*args):
        fault(*args)
        return real(*args)
    setattr(owner, name, call)


def _poison(error):
    """A fault raising `error` when the call's first argument holds the poisoned request (a
    Sequence: once it has a few output tokens, so the fault hits mid-reply)."""
    def fault(entries, *rest):
        if isinstance(entries, Sequence):
            hit = _poisoned([entries]) and entries.num_output_tokens > 2
        else:
            hit = _poisoned([e.seq for e in entries])
        if hit:
            raise error
    return fault


def _once_after_a_few_steps(core, error):
    """A fault no request explains: it fires once, mid-run."""
    fired = []

    def fault(*_):
        if core.step_id > 3 and not fired:
            fired.append(1)
            raise error
    return fault


def _plant(llm, stage: str) -> bool:
    """Make `stage` raise for any step holding the poisoned request (attributable stages, True),
    or once mid-run (the stages no request's data explains, False)."""
    core = llm.core
    attributable = {"probe_plan": (core.probes, "plan", IndexError),
                    "intervention_plan": (core.interventions, "plan", OverflowError),
                    "sampling_batch": (core, "_banned", ValueError),
                    "postprocess": (core, "_token_event", KeyError)}
    if stage in attributable:
        owner, name, kind = attributable[stage]
        _wrap(owner, name, _poison(kind(f"{stage} (injected)")))
        return True
    if stage == "launch":
        _poison_forward(llm)
        return True
    if stage == "wait":         # the step launched; waiting for the device fails
        real = core.runner.execute_step
        fault = _once_after_a_few_steps(core, RuntimeError("device wait (injected)"))

        def execute_step(inp):
            out = real(inp)
            try:
                fault()
            except RuntimeError as e:
                def wait(*a, err=e, **kw):
                    raise err
                out.wait = wait
            return out
        core.runner.execute_step = execute_step
        return False
    owner, name = {"schedule": (core.scheduler, "schedule"), "trace": (core, "_record")}[stage]
    _wrap(owner, name, _once_after_a_few_steps(core, RuntimeError(f"{stage} (injected)")))
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
        results, errors = _concurrent(llm, healthy + [bad], GREEDY, ["h0", "h1", "h2", "bad"])
        results = {i: [e.token_id for e in evs if e.token_id is not None]
                   for i, evs in results.items()}
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
