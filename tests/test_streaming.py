"""LLM.stream: concurrent streams get the same greedy tokens as generate; aborting (llm.abort or
closing the generator) ends the stream with "abort", frees every block of the request, and the
engine keeps serving."""
from __future__ import annotations

import threading

import pytest

from engine import LLM, SamplingParams
from test_generate_vs_hf import random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
LONG = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(qwen3_dir):
    engine = LLM(qwen3_dir, device="cpu", block_size=4)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def probe(llm):
    """A prompt and its greedy reply, to check the engine still serves correctly."""
    prompt = random_prompts([13], seed=41)[0]
    return prompt, llm.generate(prompt, GREEDY)[0].token_ids


def tokens_of(events) -> list[int]:
    return [e.token_id for e in events if e.token_id is not None]


def assert_request_gone(llm: LLM, request_id: str) -> None:
    snap = llm.inspect()
    assert request_id not in snap.block_tables
    assert request_id not in snap.running and request_id not in snap.waiting
    for b in snap.blocks:
        assert request_id not in b.owners, f"block {b.block_id} still lists {request_id}"
        assert b.ref_count == len(b.owners), f"block {b.block_id}: ref count != owners"
    assert snap.num_free_blocks == sum(b.ref_count == 0 for b in snap.blocks)
    with llm.loop.lock:
        llm.block_manager.check_invariants(llm.scheduler.all_sequences())
    assert llm.abort(request_id) is False


def assert_still_serving(llm: LLM, probe) -> None:
    prompt, expected = probe
    assert llm.generate(prompt, GREEDY)[0].token_ids == expected


def test_four_concurrent_streams_get_the_same_tokens_as_generate(llm):
    prompts = random_prompts([4, 9, 15, 22], seed=42)
    expected = llm.generate(prompts, GREEDY)
    results: dict[int, list] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(4)

    def consume(i):
        try:
            start.wait()
            results[i] = list(llm.stream(prompts[i], GREEDY, request_id=f"conc-{i}"))
        except BaseException as e:      # surface thread failures in the test
            errors.append(e)

    threads = [threading.Thread(target=consume, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    for i, o in enumerate(expected):
        events = results[i]
        assert tokens_of(events) == o.token_ids
        assert events[-1].finished and events[-1].finish_reason == "length"
        assert events[-1].output_text == o.text
    steps = llm.inspect().steps
    assert any(sum(e.request_id.startswith("conc-") for e in s.entries) >= 2 for s in steps), \
        "the streams never shared a step"


def test_stream_event_texts_concatenate_to_the_final_text(llm):
    prompt = random_prompts([6], seed=43)[0]
    events = list(llm.stream(prompt, GREEDY))
    assert all(not e.finished for e in events[:-1]) and events[-1].finished
    texts = [e.text for e in events]
    for i, e in enumerate(events):
        assert e.output_text == "".join(texts[:i + 1])
    assert events[-1].output_text == llm.generate(prompt, GREEDY)[0].text


def test_abort_mid_stream_ends_with_abort_and_frees_every_block(llm, probe):
    prompt = random_prompts([10], seed=44)[0]
    stream = llm.stream(prompt, LONG, request_id="victim")
    events = [next(stream) for _ in range(3)]
    assert llm.inspect().block_tables.get("victim"), "the request holds no blocks to free"
    assert llm.abort("victim") is True
    events += list(stream)
    assert events[-1].finished and events[-1].finish_reason == "abort"
    assert len(tokens_of(events)) < LONG.max_tokens
    assert_request_gone(llm, "victim")
    assert_still_serving(llm, probe)


def test_closing_a_stream_early_aborts_the_request(llm, probe):
    prompt = random_prompts([10], seed=45)[0]
    stream = llm.stream(prompt, LONG, request_id="closer")
    for _ in range(3):
        next(stream)
    stream.close()
    assert_request_gone(llm, "closer")
    assert_still_serving(llm, probe)


def test_abort_does_not_disturb_other_requests(llm):
    prompts = random_prompts([7, 12], seed=46)
    expected = llm.generate(prompts[0], GREEDY)[0].token_ids
    victim = llm.stream(prompts[1], LONG, request_id="victim-2")
    next(victim)
    other = llm.stream(prompts[0], GREEDY)
    got = [next(other)]
    llm.abort("victim-2")
    got += list(other)
    assert tokens_of(got) == expected
    assert list(victim)[-1].finish_reason == "abort"


def test_abort_of_an_unknown_request_returns_false(llm):
    assert llm.abort("no-such-request") is False


def test_two_engines_in_one_process_run_at_once(qwen3_dir):
    """Each engine's forward reads its own context, even when both step at the same time."""
    import threading as th

    from engine import LLM, SamplingParams
    engines = [LLM(qwen3_dir, device="cpu", num_kv_blocks=64, block_size=4) for _ in range(2)]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [3, 4, 5]]
    try:
        ref = [o.token_ids for o in engines[0].generate(prompts, sp)]
        got: dict = {}

        def run(i):
            got[i] = [[o.token_ids for o in engines[i].generate(prompts, sp)] for _ in range(3)]
        threads = [th.Thread(target=run, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert got[0] == got[1] == [ref] * 3
    finally:
        for e in engines:
            e.shutdown()


# ---- submit(on_event=...): events delivered by the engine thread, no thread per request ------
def test_submit_delivers_the_same_tokens_as_generate_on_the_engine_thread(llm):
    prompts = random_prompts([5, 11, 17], seed=44)
    expected = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    got: dict[str, list] = {}
    threads: set[str] = set()
    done = threading.Event()

    def sink_for(rid):
        def on_event(ev):
            threads.add(threading.current_thread().name)
            got.setdefault(rid, []).append(ev)
            if sum(bool(evs and getattr(evs[-1], "finished", False)) for evs in got.values()) == 3:
                done.set()
        return on_event

    rids = [f"submit-{i}" for i in range(3)]
    for rid, p in zip(rids, prompts):
        assert llm.submit(p, GREEDY, request_id=rid, on_event=sink_for(rid)) == rid
    assert done.wait(60), "not every submitted request finished"
    assert [tokens_of(got[r]) for r in rids] == expected
    assert all(got[r][-1].finished and got[r][-1].finish_reason == "length" for r in rids)
    assert threads == {llm.loop._thread.name}, "events must come from the engine loop thread"
    for rid in rids:
        assert_request_gone(llm, rid)


def test_submit_refuses_a_bad_prompt_at_once(llm):
    calls = []
    with pytest.raises(ValueError):
        llm.submit([], GREEDY, on_event=calls.append)
    assert calls == []


def test_a_raising_on_event_fails_no_other_request(llm, probe):
    boom = threading.Event()

    def bad(ev):
        boom.set()
        raise RuntimeError("consumer bug")

    rid = llm.submit(random_prompts([7], seed=45)[0], GREEDY, on_event=bad)
    assert boom.wait(30)
    assert_still_serving(llm, probe)
    deadline = threading.Event()
    for _ in range(100):                    # it still runs to its end and frees its blocks
        if rid not in llm.inspect().block_tables:
            break
        deadline.wait(0.05)
    assert_request_gone(llm, rid)


def test_abort_of_a_submitted_request_ends_it_with_abort(llm, probe):
    events, first = [], threading.Event()

    def on_event(ev):
        events.append(ev)
        first.set()

    rid = llm.submit(random_prompts([9], seed=46)[0], LONG, on_event=on_event)
    assert first.wait(30)
    assert llm.abort(rid) is True
    assert events[-1].finished and events[-1].finish_reason == "abort"
    assert_request_gone(llm, rid)
    assert_still_serving(llm, probe)
