"""Speculative decoding with a draft model (engine/spec_decode/draft_model.py): the output is
plain decoding's (greedy token for token, seeded sampling token for token, with a draft that
agrees always, often or never), a target drafting for itself accepts every draft, the draft's
paged KV cache holds exactly the accepted context after every verify (its next-token logits
equal a fresh HF forward's) and is empty when the requests are done, proposals are batched
across requests, and a draft that cannot serve the target is refused by name."""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from engine.errors import InvalidArgumentError
from engine.spec_decode import SpeculativeConfig

ASSETS = Path(__file__).resolve().parents[1] / "assets"
DENSE, MOE = str(ASSETS / "demo-qwen3"), str(ASSETS / "demo-qwen3-moe")


def _spec(draft, k=4, **kw) -> dict:
    return {"model": draft, "num_speculative_tokens": k, **kw}


def _prompts(n: int = 3) -> list[list[int]]:
    rng = np.random.default_rng(1)
    return [rng.integers(3, 190, size=6 + 3 * i).tolist() for i in range(n)]


def _engine(path, spec=None, **kw) -> LLM:
    kw.setdefault("block_size", 4)
    kw.setdefault("num_kv_blocks", 96)
    return LLM(path, device="cpu", speculative_config=spec, **kw)


def _same(plain, spec):
    for x, y in zip(plain, spec, strict=True):
        assert y.token_ids == x.token_ids, (x.request_id, x.token_ids, y.token_ids)
        assert (y.finish_reason, y.text) == (x.finish_reason, x.text)


def _counts(outs) -> tuple[int, int]:
    verdicts = [v for o in outs for v in o.drafts]
    return sum(len(v.drafted) for v in verdicts), sum(v.num_accepted for v in verdicts)


def _all_free(llm: LLM) -> None:
    """Both caches sound and empty: no block of the target's or the draft's leaked."""
    with llm.loop.lock:
        llm.block_manager.check_invariants(llm.scheduler.all_sequences())
        assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks
        llm.draft.check_invariants()
        dbm = llm.draft.block_manager
        assert dbm.num_free_blocks == dbm.num_blocks and not llm.draft.live


@pytest.fixture(scope="module")
def near_draft(qwen3_dir, tmp_path_factory) -> str:
    """The tiny target with noise on its MLP weights: a draft that agrees with it often, not
    always (acceptance and rejection both happen)."""
    from safetensors.torch import load_file, save_file
    d = tmp_path_factory.mktemp("near_draft")
    shutil.copytree(qwen3_dir, d, dirs_exist_ok=True)
    f = d / "model.safetensors"
    w = load_file(str(f))
    g = torch.Generator().manual_seed(0)
    for name, t in w.items():
        if ".mlp." in name:
            w[name] = t + 0.06 * torch.randn(t.shape, generator=g)
    save_file(w, str(f), metadata={"format": "pt"})
    return str(d)


@pytest.fixture(scope="module")
def plain(qwen3_dir):
    with _engine(qwen3_dir) as llm:
        yield llm


@pytest.fixture(scope="module")
def drafted(qwen3_dir, near_draft):
    with _engine(qwen3_dir, _spec(near_draft, adaptive_min_acceptance=0.0)) as llm:
        yield llm


# ---- config and loading ------------------------------------------------------------------------
def test_model_implies_the_draft_model_method_as_in_vllm():
    c = SpeculativeConfig.parse('{"model": "/d", "num_speculative_tokens": 3}')
    assert (c.method, c.model, c.num_speculative_tokens) == ("draft_model", "/d", 3)
    c = SpeculativeConfig.parse({"method": "draft_model", "model": "/d"})
    assert (c.method, c.model) == ("draft_model", "/d")


def test_a_draft_with_another_vocabulary_is_refused(qwen3_dir, model_factory):
    wider = model_factory("qwen3", vocab_size=640)       # the same tokenizer, other logits
    with pytest.raises(InvalidArgumentError, match="vocab_size 640") as e:
        _engine(qwen3_dir, _spec(wider))
    assert e.value.param == "speculative_config.model"
    # the demo's vocabulary size (4096), but the tiny models' tokenizer
    other_tok = model_factory("qwen3", vocab_size=4096)
    with pytest.raises(InvalidArgumentError, match="different tokenizer") as e:
        LLM(DENSE, device="cpu", num_kv_blocks=16, speculative_config=_spec(other_tok))
    assert e.value.param == "speculative_config.model"


# ---- exactness -----------------------------------------------------------------------------------
def test_a_target_drafting_for_itself_accepts_every_draft(qwen3_dir, plain):
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    with _engine(qwen3_dir, _spec(qwen3_dir)) as llm:
        out = llm.generate(_prompts(), params)
        _all_free(llm)
    _same(plain.generate(_prompts(), params), out)
    drafted, accepted = _counts(out)
    assert drafted > 3 * 10 and accepted == drafted


def test_greedy_with_a_draft_that_often_agrees_equals_plain(plain, drafted):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2)
    a, b = plain.generate(_prompts(), params), drafted.generate(_prompts(), params)
    _same(a, b)
    for x, y in zip(a, b):
        np.testing.assert_allclose([lp.logprob for lp in y.logprobs],
                                   [lp.logprob for lp in x.logprobs], atol=1e-4)
    n, acc = _counts(b)
    assert 0 < acc < n, (acc, n)
    _all_free(drafted)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.9, seed=11, max_tokens=30, ignore_eos=True),
    SamplingParams(temperature=1.1, top_k=12, top_p=0.9, seed=3, max_tokens=30, ignore_eos=True),
    SamplingParams(temperature=0.7, min_p=0.05, seed=8, max_tokens=30, ignore_eos=True,
                   logit_bias={7: 3.0}),
    SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, presence_penalty=0.5,
                   frequency_penalty=0.3, repetition_penalty=1.2),
    SamplingParams(temperature=0, max_tokens=20, min_tokens=12, stop_token_ids=[5, 6, 7]),
], ids=["temperature", "top-k-top-p", "min-p-logit-bias", "penalties", "min-tokens"])
def test_sampling_settings_with_a_draft_give_the_plain_tokens(plain, drafted, params):
    """Greedy drafts (q one-hot) are verified with the request's own sampler and noise: a
    seeded request speculates to exactly its plain tokens, so its distribution is the
    target's (the rule itself is χ²-tested in test_spec_decode.py)."""
    a, b = plain.generate(_prompts(), params), drafted.generate(_prompts(), params)
    _same(a, b)
    assert _counts(b)[0] > 0
    _all_free(drafted)


def test_the_dense_demo_drafts_for_the_moe_demo():
    chats = [[{"role": "user", "content": c}] for c in
             ("Copy: glass box glass box", "Sort: 42 7 19 3 11 5", "Reverse: c a t s d o g")]
    params = SamplingParams(temperature=0, max_tokens=40)
    with LLM(MOE, device="cpu", num_kv_blocks=64) as llm:
        a = llm.generate(chats, params)
    with LLM(MOE, device="cpu", num_kv_blocks=64, speculative_config=_spec(DENSE)) as llm:
        b = llm.generate(chats, params)
        _all_free(llm)
    _same(a, b)
    n, acc = _counts(b)
    assert acc > n / 3, (acc, n)


def test_per_request_draft_lengths_and_plain_requests_in_one_batch(plain, drafted):
    params = [SamplingParams(temperature=0, max_tokens=25, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=25, ignore_eos=True,
                             num_speculative_tokens=0),
              SamplingParams(temperature=0, max_tokens=25, ignore_eos=True,
                             num_speculative_tokens=2)]
    a, b = plain.generate(_prompts(), params), drafted.generate(_prompts(), params)
    _same(a, b)
    assert b[0].drafts and not b[1].drafts and b[2].drafts
    assert max(len(v.drafted) for v in b[2].drafts) == 2
    _all_free(drafted)


# ---- the draft's paged KV cache ----------------------------------------------------------------
def test_after_every_verify_the_draft_cache_holds_exactly_the_accepted_context(
        qwen3_dir, near_draft, monkeypatch):
    """At each verdict: the draft's tokens are the request's accepted context (no rejected
    draft), its blocks just cover them, and its next-token logits computed from the cache
    equal a fresh HF forward of that context."""
    from tiny_models import load_hf

    from engine.scheduler import ScheduledSeq
    from engine.spec_decode.draft_model import DraftSeq
    from engine.step_inputs import build_step_inputs
    hf = load_hf(near_draft)
    checked, rejected = [], []
    on_verdict = DraftSeq.on_verdict

    def checked_on_verdict(st, v):
        before = st.num_computed_tokens
        on_verdict(st, v)
        # the request's tokens before the drafts (cut already) and the drafts it kept
        ctx = st.seq.token_ids[:v.position] + list(v.drafted[:v.num_accepted])
        m = len(st.token_ids)
        assert st.num_computed_tokens == m == min(len(ctx), before)
        assert st.token_ids == ctx[:m]
        assert len(st.block_table) == st.draft.block_manager.blocks_for(m)
        st.draft.check_invariants()
        rejected.append(len(v.drafted) - v.num_accepted)
        if len(checked) < 6 and rejected[-1]:
            # re-feed the newest cached token: attention reads every other one from the cache
            inp = build_step_inputs(-1, [ScheduledSeq(st, 1, m - 1)], st.draft.runner.block_size,
                                    None)
            got = st.draft.runner.execute(inp)[0]
            with torch.no_grad():
                want = hf(torch.tensor([st.token_ids])).logits[0, -1]
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
            checked.append(v)
    monkeypatch.setattr(DraftSeq, "on_verdict", checked_on_verdict)
    with _engine(qwen3_dir, _spec(near_draft, adaptive_min_acceptance=0.0),
                 block_size=2) as llm:
        llm.generate(_prompts(), SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
        _all_free(llm)
    assert len(checked) == 6


def test_drafts_never_verified_are_cut_from_the_draft_cache(drafted):
    """Drafts proposed but never verified (the target's cache had no room for them): the next
    proposal first cuts the draft's cache back to what it shares with the request."""
    from engine.sequence import Sequence
    draft = drafted.draft
    with drafted.loop.lock:
        seq = Sequence("unverified", _prompts(1)[0], SamplingParams(max_tokens=50,
                                                                    ignore_eos=True), 0)
        st = draft.proposer(seq)
        first = st(seq.token_ids, 4)
        assert len(first) == 4 and len(st.token_ids) == len(seq.token_ids) + 3
        # the target decoded two tokens plainly since, the first of them another than the draft's
        seq.token_ids += [(first[0] + 1) % 100, first[1]]
        again = st(seq.token_ids, 4)
        assert st.token_ids[:len(seq.token_ids)] == seq.token_ids
        fresh = draft.proposer(seq)
        assert again == fresh(seq.token_ids, 4)             # as if proposed from scratch
        draft.check_invariants()
        st.release()
        fresh.release()
    _all_free(drafted)


def test_speculation_with_a_draft_under_a_tiny_cache_with_preemption_equals_plain(
        qwen3_dir, near_draft):
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    prompts = _prompts(5)
    with _engine(qwen3_dir, num_kv_blocks=36) as llm:
        a = llm.generate(prompts, params)
    with _engine(qwen3_dir, _spec(near_draft, adaptive_min_acceptance=0.0),
                 num_kv_blocks=36) as llm:
        b = llm.generate(prompts, params)
        assert llm.scheduler.num_preemptions > 0
        _all_free(llm)
    _same(a, b)


def test_proposals_are_batched_across_requests_and_timed_as_proposing(drafted):
    calls = []
    execute = drafted.draft.runner.execute_step

    def counted(inp):
        calls.append(inp.num_seqs)
        return execute(inp)
    drafted.draft.runner.execute_step = counted
    try:
        drafted.generate(_prompts(), SamplingParams(temperature=0, max_tokens=20,
                                                    ignore_eos=True))
    finally:
        drafted.draft.runner.execute_step = execute
    assert max(calls) == 3, "the draft never ran the three requests in one forward"
    verify = [t for t in drafted.inspect().steps if t.num_draft_tokens]
    assert verify and all(0 < t.t_propose <= t.t_schedule for t in verify)


def test_a_draft_model_runs_no_forward_while_the_batch_is_past_disable_by_batch_size(
        qwen3_dir, near_draft, plain):
    """disable_by_batch_size=2 with three requests: the draft model's batched proposals (and
    its forwards) wait until one request has finished; the replies are plain decoding's."""
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 20, 20)]
    spec = _spec(near_draft, adaptive_min_acceptance=0.0, disable_by_batch_size=2)
    with _engine(qwen3_dir, spec) as llm:
        running = []
        propose = llm.draft.propose

        def spy(items):
            running.append(len(llm.scheduler.running))
            return propose(items)
        llm.draft.propose = spy
        got = llm.generate(_prompts(), params)
        _all_free(llm)
    _same(plain.generate(_prompts(), params), got)
    assert running and max(running) <= 2, running
    assert sum(len(o.drafts) for o in got[1:]) > 0


def test_a_draft_that_never_agrees_backs_off_and_returns_its_blocks(model_factory, qwen3_dir):
    """A random draft for a random MoE target: every request stops speculating after a few
    proposals (adaptive back-off) and gives its draft blocks back while it still decodes."""
    moe = model_factory("qwen3_moe")
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    with _engine(moe) as llm:
        a = llm.generate(_prompts(), params)
    with _engine(moe, _spec(qwen3_dir)) as llm:
        b = llm.generate(_prompts(), params)
        _all_free(llm)
    _same(a, b)
    assert all(o.drafts and not o.metrics["spec_decode"]["speculating"] for o in b)
    assert all(len(o.drafts) < 20 for o in b)


def test_overlap_scheduling_and_tensor_parallelism_with_a_draft_equal_plain(
        qwen3_dir, near_draft, plain):
    """TP=2 over gloo: the draft runs unsharded on rank 0; its drafts reach every rank in the
    step's inputs."""
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0.9, seed=3, max_tokens=20, ignore_eos=True)]
    a = plain.generate(_prompts(2), params)
    for kw in ({"async_scheduling": True}, {"tensor_parallel_size": 2, "num_kv_blocks": 48}):
        with _engine(qwen3_dir, _spec(near_draft, adaptive_min_acceptance=0.0), **kw) as llm:
            b = llm.generate(_prompts(2), params)
            _all_free(llm)
        _same(a, b)
        assert _counts(b)[1] > 0


def test_guided_drafts_are_always_legal_and_the_output_equals_plain():
    """Structured output: the draft's rows are masked by the grammar advanced through its
    drafts so far, so every draft a guided request proposes is a legal continuation."""
    schema = {"type": "object", "properties": {
        "n": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}}},
        "required": ["n", "tags"], "additionalProperties": False}
    params = [SamplingParams(temperature=0, max_tokens=80, guided={"json_schema": schema}),
              SamplingParams(seed=3, max_tokens=80, guided={"regex": "(ab|cd){3,12}"}),
              SamplingParams(temperature=0, max_tokens=20, allowed_token_ids=list(range(40)))]
    prompts = ["Copy: glass box", "b", "c"]
    with LLM(MOE, device="cpu", num_kv_blocks=64) as llm:
        a = llm.generate(prompts, params)
    with LLM(MOE, device="cpu", num_kv_blocks=64,
             speculative_config=_spec(DENSE, adaptive_min_acceptance=0.0)) as llm:
        b = llm.generate(prompts, params)
        _all_free(llm)
        for o, p, prompt in zip(b[:2], params, prompts):
            assert o.drafts
            for v in o.drafts:
                g = llm.process(prompt, p).grammar         # a fresh matcher
                for t in (o.prompt_token_ids + o.token_ids)[len(o.prompt_token_ids):v.position]:
                    assert g.matcher.consume_token(t)
                for t in v.drafted:                 # (try_consume_tokens stops at an EOS)
                    assert g.matcher.consume_token(t) and not g.matcher.is_error(), v
        assert all(t < 40 for v in b[2].drafts for t in v.drafted)
    _same(a, b)


def test_a_watched_request_s_verdicts_carry_the_draft_s_top_guesses(plain, drafted):
    """The Layers tab's rejection view shows the draft's own top guesses beside the target's:
    a watched request's verdicts carry them (the first is the greedy draft itself, the
    probabilities a descending distribution's); an unwatched request's carry none."""
    from engine import ProbeSpec
    from engine.spec_decode.draft_sampling import DRAFT_TOP_K
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = drafted.generate(_prompts(2), params, watch=[ProbeSpec(), None])
    _same(plain.generate(_prompts(2), params), outs)
    watched, other = outs
    assert watched.drafts and other.drafts
    for v in watched.drafts:
        assert len(v.draft_top_ids) == len(v.drafted) == len(v.draft_top_probs)
        for tok, ids, probs in zip(v.drafted, v.draft_top_ids, v.draft_top_probs):
            assert len(ids) == DRAFT_TOP_K and ids[0] == tok
            assert all(a >= b for a, b in zip(probs, probs[1:])) and 0 < sum(probs) <= 1 + 1e-4
    assert all(v.draft_top_ids is None for v in other.drafts)
    _all_free(drafted)
