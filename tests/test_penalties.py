"""Presence, frequency and repetition penalties and logit_bias in the sampler, exact against
HF's RepetitionPenaltyLogitsProcessor and OpenAI's definition (a reference written here), per
row, with the newest token still on the device (overlap scheduling), and end to end against HF
generate on a tiny random Qwen."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from engine.penalties import PenaltyBatch, PenaltyTensors, apply_penalties
from engine.step_inputs import PENDING

V = 64


class FakeSeq:
    def __init__(self, prompt, output, params, pending=None):
        self.token_ids = list(prompt) + list(output)
        self.num_prompt_tokens = len(prompt)
        self.params = params
        self.pending = pending or {}

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


def test_penalties_equal_hf_and_openai_per_row():
    g = torch.Generator().manual_seed(int(np.random.SeedSequence().entropy % 2**31))
    cases = _random_case(g, 12)
    logits = torch.randn(len(cases), V, generator=g) * 3
    batch = PenaltyBatch.build([FakeSeq(*c) for c in cases], -1)
    got = apply_penalties(logits, PenaltyTensors.from_batch(batch, "cpu", None))
    for r, (prompt, output, p) in enumerate(cases):
        torch.testing.assert_close(got[r], openai_reference(logits[r], prompt, output, p),
                                   atol=1e-5, rtol=1e-5)


def test_the_newest_token_on_the_device_counts_like_a_known_one():
    g = torch.Generator().manual_seed(3)
    p = SamplingParams(presence_penalty=0.5, frequency_penalty=0.9, repetition_penalty=1.4)
    prompt, output = [1, 2, 3], [4, 4, 9, 17]
    logits = torch.randn(2, V, generator=g)
    known = FakeSeq(prompt, output, p)
    # the same history, its last token still on the device: index 1 of the previous sample
    pending = FakeSeq(prompt, output[:-1] + [PENDING], p, {len(prompt) + 3: (7, 1)})
    prev = torch.tensor([0, output[-1], 0])
    a = apply_penalties(logits, PenaltyTensors.from_batch(
        PenaltyBatch.build([known, known], -1), "cpu", None))
    b = apply_penalties(logits, PenaltyTensors.from_batch(
        PenaltyBatch.build([known, pending], 7), "cpu", prev))
    torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_rows_without_penalties_are_untouched():
    logits = torch.randn(3, V)
    seqs = [FakeSeq([1, 2], [5, 5], SamplingParams()),
            FakeSeq([1, 2], [5, 5], SamplingParams(repetition_penalty=2.0)),
            FakeSeq([1, 2], [5, 5], SamplingParams())]
    got = apply_penalties(logits, PenaltyTensors.from_batch(PenaltyBatch.build(seqs, -1),
                                                            "cpu", None))
    assert torch.equal(got[0], logits[0]) and torch.equal(got[2], logits[2])
    assert not torch.equal(got[1], logits[1])


def test_no_penalty_batch_is_built_when_unused():
    assert not PenaltyBatch.needed(SamplingParams(temperature=0.5, top_k=3))
    assert PenaltyBatch.needed(SamplingParams(logit_bias={3: 1.0}))


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
        r = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
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
