"""Presence, frequency and repetition penalties and logit_bias in the sampler, exact against
HF's RepetitionPenaltyLogitsProcessor and OpenAI's definition (a reference written here), per
row, step after step from the device's persistent count rows (the newest token still on the
device under overlap scheduling, rows reused after a request finishes, rebuilt after a failed
launch), and end to end against HF generate on a tiny random Qwen (preemption, n copies of a
prompt, a second batch through reused rows)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from engine.penalties import PenaltyState, apply_penalties
from engine.penalty_slots import PenaltySlots
from engine.step_inputs import PENDING

V = 64


class FakeSeq:
    def __init__(self, prompt, output, params, pending=None):
        self.token_ids = list(prompt) + list(output)
        self.num_prompt_tokens = len(prompt)
        self.params = params
        self.pending = pending or {}
        self.is_finished = False

    @property
    def prompt_token_ids(self):
        return self.token_ids[:self.num_prompt_tokens]

    def pending_src(self, pos, step_id):
        return self.pending[pos][1]


def openai_reference(logits, prompt, output, p):
    """The reference: logit_bias, then HF's repetition processor, then OpenAI's penalties."""
    from transformers import RepetitionPenaltyLogitsProcessor
    x = logits.clone()[None]
    for t, b in p.logit_bias:
        x[0, t] += b
    if p.repetition_penalty != 1.0:
        ids = torch.tensor([list(prompt) + list(output)])
        x = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(ids, x)
    counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=V).float() \
        if output else torch.zeros(V)
    return x[0] - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).float()


def _random_case(g: torch.Generator, rows: int):
    cases = []
    for r in range(rows):
        prompt = torch.randint(0, V, (int(torch.randint(1, 12, (1,), generator=g)),),
                               generator=g).tolist()
        output = torch.randint(0, V, (int(torch.randint(0, 15, (1,), generator=g)),),
                               generator=g).tolist()
        kind = r % 4
        p = SamplingParams(
            presence_penalty=[0.0, 0.7, -0.5, 1.5][kind],
            frequency_penalty=[0.0, 0.4, 0.0, -1.2][kind],
            repetition_penalty=[1.0, 1.3, 0.8, 1.0][kind],
            logit_bias={} if kind != 3 else {int(torch.randint(0, V, (1,), generator=g)): 5.0,
                                             3: -100})
        cases.append((prompt, output, p))
    return cases


def _penalise(slots, state, seqs, logits, prev_step_id=-1, prev_sampled=None):
    """One step: the host's batch, the device's update, the sampler's penalties."""
    b = slots.batch(seqs, prev_step_id)
    return apply_penalties(logits, state.step(b, logits.shape[-1], prev_sampled))


def _check(got, seqs):
    for r, s in enumerate(seqs):
        want = openai_reference(LOGITS[r], s.prompt_token_ids,
                                s.token_ids[s.num_prompt_tokens:], s.params)
        torch.testing.assert_close(got[r], want, atol=1e-5, rtol=1e-5)


LOGITS = torch.randn(16, V) * 3


def test_penalties_equal_hf_and_openai_per_row_step_after_step():
    g = torch.Generator().manual_seed(int(np.random.SeedSequence().entropy % 2**31))
    seqs = [FakeSeq(*c) for c in _random_case(g, 12)]
    slots, state = PenaltySlots(), PenaltyState("cpu")
    for _ in range(4):      # each step appends a token: the rows count only the new ones
        _check(_penalise(slots, state, seqs, LOGITS[:len(seqs)]), seqs)
        for s in seqs:
            s.token_ids.append(int(torch.randint(0, V, (1,), generator=g)))


def test_the_newest_token_on_the_device_counts_like_a_known_one():
    g = torch.Generator().manual_seed(3)
    p = SamplingParams(presence_penalty=0.5, frequency_penalty=0.9, repetition_penalty=1.4)
    prompt, output = [1, 2, 3], [4, 4, 9, 17]
    logits = torch.randn(2, V, generator=g)
    known = FakeSeq(prompt, output, p)
    # the same history, its last token still on the device: index 1 of the previous sample
    pending = FakeSeq(prompt, output[:-1] + [PENDING], p, {len(prompt) + 3: (7, 1)})
    prev = torch.tensor([0, output[-1], 0])
    a = _penalise(PenaltySlots(), PenaltyState("cpu"), [known, known], logits)
    b = _penalise(PenaltySlots(), PenaltyState("cpu"), [known, pending], logits, 7, prev)
    torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_rows_without_penalties_are_untouched():
    logits = torch.randn(3, V)
    seqs = [FakeSeq([1, 2], [5, 5], SamplingParams()),
            FakeSeq([1, 2], [5, 5], SamplingParams(repetition_penalty=2.0)),
            FakeSeq([1, 2], [5, 5], SamplingParams())]
    got = _penalise(PenaltySlots(), PenaltyState("cpu"), seqs, logits)
    assert torch.equal(got[0], logits[0]) and torch.equal(got[2], logits[2])
    assert not torch.equal(got[1], logits[1])


def test_a_finished_requests_row_is_cleared_for_its_next_owner():
    p = SamplingParams(presence_penalty=1.0, frequency_penalty=0.5, repetition_penalty=1.5)
    slots, state = PenaltySlots(), PenaltyState("cpu")
    old = FakeSeq([7, 8, 9], [1, 1, 2, 30], p)
    _penalise(slots, state, [old], LOGITS[:1])
    old.is_finished = True
    new = FakeSeq([10, 11], [3], p)
    got = _penalise(slots, state, [new], LOGITS[:1])
    assert slots.slot_of(new) == 0, "the finished request's row was not reused: not tested"
    _check(got, [new])


def test_a_failed_launch_rebuilds_the_rows_it_may_have_missed():
    p = SamplingParams(frequency_penalty=1.0, repetition_penalty=1.3)
    slots, state = PenaltySlots(), PenaltyState("cpu")
    seq = FakeSeq([5, 6], [1, 2], p)
    _penalise(slots, state, [seq], LOGITS[:1])
    seq.token_ids += [2, 40]
    slots.batch([seq], -1)            # built, then the launch failed before the device saw it
    slots.invalidate([seq])
    seq.token_ids += [41]
    _check(_penalise(slots, state, [seq], LOGITS[:1]), [seq])


def test_the_fused_kernel_equals_its_torch_reference(triton_interpreter):
    from engine.kernels.penalties_kernel import apply_count_penalties, apply_count_penalties_ref
    g = torch.Generator().manual_seed(int(np.random.SeedSequence().entropy % 2**31))
    v, S, B = 300, 5, 4                     # not a multiple of the block: a partial last chunk
    counts = torch.randint(0, 3, (S, v), generator=g, dtype=torch.int32)
    seen = torch.rand(S, v, generator=g) < 0.2
    rows, slot_ids = torch.tensor([3, 0, 2]), torch.tensor([4, 1, 1])
    pres, freq = torch.randn(3, generator=g), torch.randn(3, generator=g)
    rep = torch.rand(3, generator=g) + 0.5
    logits = torch.randn(B, v, generator=g) * 3
    want = apply_count_penalties_ref(logits.clone(), rows, slot_ids, counts, seen, pres, freq, rep)
    got = apply_count_penalties(logits.clone(), rows, slot_ids, counts, seen, pres, freq, rep,
                                block=128)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    assert torch.equal(got[1], logits[1]), "a row without penalties changed"


def test_no_penalty_batch_is_built_when_unused():
    assert not SamplingParams(temperature=0.5, top_k=3).uses_penalties
    assert SamplingParams(logit_bias={3: 1.0}).uses_penalties


@pytest.mark.parametrize("bad", [dict(presence_penalty=2.5), dict(frequency_penalty=-3),
                                 dict(repetition_penalty=0), dict(logit_bias={5: 101}),
                                 dict(logit_bias={"x": 1})])
def test_out_of_range_penalties_are_refused(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


# ---- end to end against HF generate -------------------------------------------------------
class OpenAIPenalties:
    """An HF LogitsProcessor: OpenAI's presence / frequency penalties on the generated part."""

    def __init__(self, prompt_len, presence, frequency):
        self.n, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids, scores):
        out = input_ids[:, self.n:]
        counts = torch.zeros_like(scores)
        if out.shape[1]:
            counts.scatter_add_(1, out, torch.ones_like(out, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).float()


def _hf_generate(path, prompt, n, **kw):
    from transformers import LogitsProcessorList
    from tiny_models import load_hf
    hf = load_hf(path)
    hf.generation_config.eos_token_id = None
    procs = LogitsProcessorList()
    if kw.get("presence") or kw.get("frequency"):
        procs.append(OpenAIPenalties(len(prompt), kw.get("presence", 0), kw.get("frequency", 0)))
    with torch.no_grad():
        ids = torch.tensor([prompt])
        # an explicit mask: with pad_token_id=0 HF would infer one and mask every prompt
        # token 0 as padding (a random prompt holds one in ~5 % of draws)
        r = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                        repetition_penalty=kw.get("repetition", 1.0), logits_processor=procs,
                        pad_token_id=0)
    return r[0, len(prompt):].tolist()


@pytest.mark.parametrize("overlap", [False, True])
def test_greedy_with_penalties_equals_hf_generate(model_factory, overlap):
    path = model_factory("qwen3")
    g = torch.Generator().manual_seed(21)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (7, 12)]
    n = 24
    with LLM(path, device="cpu", num_kv_blocks=64, async_scheduling=overlap) as llm:
        outs = llm.generate(prompts + [prompts[0]], [
            SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, repetition_penalty=1.5),
            SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, presence_penalty=1.0,
                           frequency_penalty=0.8),
            SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)])      # untouched
    assert outs[0].token_ids == _hf_generate(path, prompts[0], n, repetition=1.5)
    assert outs[1].token_ids == _hf_generate(path, prompts[1], n, presence=1.0, frequency=0.8)
    assert outs[2].token_ids == _hf_generate(path, prompts[0], n)
    assert outs[0].token_ids != outs[2].token_ids, "the penalty changed nothing: not tested"


@pytest.mark.parametrize("overlap", [False, True])
def test_counts_stay_exact_under_preemption_copies_and_reused_rows(model_factory, overlap):
    """Counts that went stale (a recompute counted twice, copies of one prompt sharing a row, a
    reused row not cleared, the in-flight token missed) change the greedy tokens."""
    path = model_factory("qwen3")
    g = torch.Generator().manual_seed(int(np.random.SeedSequence().entropy % 2**31))
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (9, 14, 6)]
    n = 20
    rep = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, repetition_penalty=1.6)
    ofs = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, presence_penalty=0.8,
                         frequency_penalty=1.1)
    # 14 blocks of 4 tokens cannot hold the five requests at full length: preemption
    with LLM(path, device="cpu", block_size=4, num_kv_blocks=14, async_scheduling=overlap) as llm:
        first = llm.generate([prompts[0]] * 3 + prompts[1:], [rep, rep, rep, ofs, rep])
        second = llm.generate(prompts[::-1], [ofs, rep, ofs])   # rows of finished requests
    assert any(o.metrics["preemptions"] for o in first), "the workload did not preempt"
    want_rep = {i: _hf_generate(path, prompts[i], n, repetition=1.6) for i in range(3)}
    want_ofs = {i: _hf_generate(path, prompts[i], n, presence=0.8, frequency=1.1)
                for i in (0, 1, 2)}
    assert [o.token_ids for o in first] == [want_rep[0]] * 3 + [want_ofs[1], want_rep[2]]
    assert [o.token_ids for o in second] == [want_ofs[2], want_rep[1], want_ofs[0]]
