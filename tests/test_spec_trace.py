"""A watched request speculates, and its trace reads as plain decoding's (the introspection
contract): norms, logit lens and attention of the accepted tokens only, every verify's verdict
beside them, and each rejection's verify row found by the Layers tab's rejection view."""
from __future__ import annotations

import numpy as np
import pytest

from engine import LLM, ProbeSpec, SamplingParams

K = 4


def _prompts() -> list[list[int]]:
    """Prompts that repeat (n-gram lookup finds drafts) with a distinct tail each."""
    rng = np.random.default_rng(1)
    return [rng.integers(3, 190, size=6 + i).tolist() * 4 + [int(rng.integers(3, 190))]
            for i in range(2)]


def _run(llm: LLM, k: int, stop=()) -> tuple[list, object]:
    """Two requests in one batch, the first watched; both speculate with k > 0."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                            num_speculative_tokens=k, stop_token_ids=tuple(stop))
    outs = llm.generate(_prompts(), params, watch=[ProbeSpec(), None])
    return outs, llm.trace(outs[0].request_id)


@pytest.fixture(scope="module")
def llm(qwen3_dir):
    # no prefix cache: the second run of a prompt recomputes its prefill as the first did
    with LLM(qwen3_dir, device="cpu", block_size=4, num_kv_blocks=96,
             enable_prefix_caching=False) as llm:
        yield llm


@pytest.fixture(scope="module")
def runs(llm):
    return _run(llm, 0), _run(llm, K)


def _same_trace(plain, spec) -> None:
    assert spec.output_token_ids == plain.output_token_ids
    np.testing.assert_allclose(spec.norms(), plain.norms(), rtol=1e-4, atol=1e-4)
    assert [s.position for s in spec.lens] == [s.position for s in plain.lens]
    for x, y in zip(plain.lens, spec.lens):
        assert y.sampled_token == x.sampled_token, x.position
        np.testing.assert_array_equal(y.top_ids, x.top_ids)
        np.testing.assert_allclose(y.top_probs, x.top_probs, atol=1e-5)
        np.testing.assert_array_equal(y.sampled_rank, x.sampled_rank)
    assert [s.position for s in spec.attention] == [s.position for s in plain.attention]
    for x, y in zip(plain.attention, spec.attention):
        assert y.probs.shape == x.probs.shape
        np.testing.assert_allclose(y.probs, x.probs, atol=1e-5)


def test_a_watched_request_speculates_and_its_trace_is_plain_decodings(runs):
    (plain_outs, plain), (spec_outs, spec) = runs
    assert [o.token_ids for o in spec_outs] == [o.token_ids for o in plain_outs]
    assert not plain.drafts and not plain_outs[0].drafts
    drafts = spec_outs[0].drafts
    # not vacuous: the watched request had drafts accepted and drafts rejected
    assert any(v.num_accepted for v in drafts), drafts
    assert any(v.num_accepted < len(v.drafted) for v in drafts), drafts
    assert spec.drafts == drafts
    _same_trace(plain, spec)


def test_a_stop_among_accepted_drafts_leaves_nothing_past_the_reply(llm, runs):
    """An oracle proposer drafts plain decoding's own tokens (all accepted); stopping on a
    token inside a verify ends the reply there, after the step computed rows past it."""
    (plain_outs, _), _ = runs
    ref = plain_outs[0].prompt_token_ids + plain_outs[0].token_ids
    out_ids = plain_outs[0].token_ids
    # a token first seen at reply index 2 or 3: inside the first verify (it drafts 1..4)
    m = next(m for m in (2, 3) if out_ids.index(out_ids[m]) == m)
    stop = [out_ids[m]]

    def proposer_for(seq):
        if list(seq.prompt_token_ids) != plain_outs[0].prompt_token_ids:
            return None                 # the other request: n-gram lookup
        return lambda token_ids, k: ref[len(token_ids):len(token_ids) + k]

    plain_outs, plain = _run(llm, 0, stop)
    llm.core.proposer_for = proposer_for
    try:
        spec_outs, spec = _run(llm, K, stop)
    finally:
        llm.core.proposer_for = None
    out = spec_outs[0]
    assert out.token_ids == plain_outs[0].token_ids == out_ids[:m + 1]
    assert out.finish_reason == "stop"
    v = out.drafts[0]
    assert v.num_accepted == len(v.drafted) == K and v.position - len(ref) + len(out_ids) < m
    _same_trace(plain, spec)
    n = len(out.prompt_token_ids) + len(out.token_ids)
    assert len(spec.resid_norms) == n - 1 and spec.lens[-1].position == n - 2


def test_the_layers_view_finds_each_rejection_and_the_verify_row_that_chose(runs):
    from views import drafts as D
    (_, _), (spec_outs, spec) = runs
    out = spec_outs[0]
    rejecting = [v for v in out.drafts if v.num_accepted < len(v.drafted)]
    rejs = D.rejections(spec)
    assert [r.verdict for r in rejs] == rejecting
    ids = out.prompt_token_ids + out.token_ids
    decode = lambda t: f"<t{t[0]}>"     # noqa: E731
    for r in rejs:
        assert r.position == r.verdict.position + r.verdict.num_accepted
        assert r.draft == r.verdict.drafted[r.verdict.num_accepted] != r.chosen
        if r.position >= len(ids):      # the reply ended (max_tokens) before this position
            continue
        assert ids[r.position] == r.chosen
        assert r.lens is not None and r.lens.position == r.position - 1
        assert r.lens.sampled_token == r.chosen
        assert int(r.lens.top_ids[-1, 0]) == r.chosen       # greedy: the target's top guess
        page = D.rejection_html(r, decode)
        assert f'data-position="{r.position}"' in page
        assert D.NGRAM_NOTE in page
        assert f'<tr data-token="{r.chosen}">' in page
    assert D.rejection_choices(rejs, decode)


def test_an_exported_trace_keeps_its_verdicts(runs, tmp_path):
    from engine import RequestTrace
    (_, _), (_, spec) = runs
    back = RequestTrace.load(spec.export(tmp_path / "t"))
    assert back.drafts == spec.drafts
