"""Each live request's record in the snapshot (its sampling choices, its grammar's state, the
API's note) and its row in the KV tab's block tables."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from engine import LLM, SamplingParams
from engine.records import RequestRecord
from views.figures_kv import block_tables_html, request_meta_html

DEMO = str(Path(__file__).resolve().parents[1] / "assets" / "demo-qwen3")
SCHEMA = {"type": "array", "items": {"type": "integer"}, "minItems": 500}   # never completes


def test_the_summary_names_exactly_the_choices_that_differ_from_the_defaults():
    assert SamplingParams().summary == "temp 1 · max 64"
    s = SamplingParams(temperature=0.7, top_p=0.9, presence_penalty=0.5,
                       repetition_penalty=1.1, logit_bias={3: 1, 9: -2}, seed=4,
                       max_tokens=10, guided={"regex": "[0-9]+"}).summary
    assert s == ("temp 0.7 · top_p 0.9 · presence 0.5 · repetition 1.1 · logit_bias 2 tok · "
                 "seed 4 · max 10 · guided")
    assert SamplingParams(temperature=0).summary.startswith("greedy")


def test_a_guided_request_is_recorded_with_its_grammar_state_and_the_apis_note():
    n_seen = int(np.random.default_rng().integers(3, 8))
    with LLM(DEMO, device="cpu", dtype="float32", num_kv_blocks=64) as llm:
        params = SamplingParams(temperature=0.8, seed=1, max_tokens=200,
                                guided={"json_schema": SCHEMA})
        stream = llm.stream("numbers:", params)
        for i, ev in enumerate(stream):
            if i + 1 == n_seen:
                break
        rid = ev.request_id
        assert llm.annotate(rid, "tool calls: get_weather({\"city\": \"Oslo\"})")
        snap = llm.inspect()
        llm.abort(rid)
        assert not llm.annotate(rid, "late")         # done: nothing to attach to
    rec = snap.requests[rid]
    assert rec.sampling == params.summary and rec.guided
    assert n_seen <= rec.masked_steps <= 200, "every sampled token was masked"
    assert rec.vocab == llm.hf_config.vocab_size and 0 < rec.allowed < rec.vocab
    assert rec.note.startswith("tool calls: get_weather")


def test_an_unguided_request_has_no_grammar_state():
    with LLM(DEMO, device="cpu", dtype="float32", num_kv_blocks=64) as llm:
        stream = llm.stream("hi", SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
        ev = next(iter(stream))
        snap = llm.inspect()
        llm.abort(ev.request_id)
    rec = snap.requests[ev.request_id]
    assert not rec.guided and rec.allowed is None and rec.masked_steps == 0 and rec.note == ""


def test_the_row_shows_sampling_grammar_and_note_escaped():
    rec = RequestRecord("temp 0.7 · presence 0.5", True, 12, 96, 4096, "tool calls: f(<x>)")
    row = request_meta_html(rec)
    assert "temp 0.7 · presence 0.5" in row
    assert "12 masked steps" in row and "4,000 of 4,096 tokens masked" in row
    assert "f(&lt;x&gt;)" in row and "<x>" not in row
    assert "grammar" not in request_meta_html(rec._replace(guided=False, allowed=None))
    assert request_meta_html(None) == ""


def test_block_tables_put_each_requests_record_in_its_row():
    with LLM(DEMO, device="cpu", dtype="float32", num_kv_blocks=64) as llm:
        a = llm.stream("one", SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
        b = llm.stream("two", SamplingParams(temperature=0.5, frequency_penalty=1.0,
                                             max_tokens=100, ignore_eos=True))
        ra, rb = next(iter(a)).request_id, next(iter(b)).request_id
        llm.annotate(rb, "tool calls: lookup({})")
        snap = llm.inspect()
        llm.abort(ra)
        llm.abort(rb)
    html = block_tables_html(snap)
    rows = {r: html[html.index(f'data-request="{r}"'):] for r in (ra, rb)}
    row_a = rows[ra].split('class="kv-trow"')[0]
    row_b = rows[rb].split('class="kv-trow"')[0]
    assert "greedy · max 100" in row_a and "tool calls" not in row_a
    assert "temp 0.5 · frequency 1 · max 100" in row_b and "tool calls: lookup({})" in row_b
