"""The sampler as a specification: top-k / top-p / min-p keep exactly the hand-computed sets,
temperature sampling follows the softmax (chi-square), seeded draws are reproducible and
independent of the batch; and through LLM: seeds, min_tokens, stop ids, stop strings, logprobs."""
from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from engine import LLM, SamplingParams
from engine.sampling import SamplingTensors, apply_filters, sample, uniform_noise
from test_generate_vs_hf import hf_greedy, random_prompts

# sorted by probability: token 3 (.40), 1 (.30), 4 (.15), 2 (.10), 0 (.05)
PROBS = torch.tensor([0.05, 0.30, 0.10, 0.40, 0.15])


def build(params: list[SamplingParams], seeds=None, positions=None, banned=()):
    n = len(params)
    return SamplingTensors.build(params, list(seeds) if seeds is not None else [0] * n,
                                 list(positions) if positions is not None else list(range(n)),
                                 list(banned), "cpu")


def kept(row: torch.Tensor) -> set[int]:
    return set(torch.nonzero(row).flatten().tolist())


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


# chi-square critical values at alpha = 0.001, by degrees of freedom
CHI2_CRIT = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515}

# ---- filters on crafted probabilities --------------------------------------------------------

FILTER_CASES = [
    (dict(top_k=1), {3}),
    (dict(top_k=2), {3, 1}),
    (dict(top_k=4), {3, 1, 4, 2}),
    (dict(top_k=50), {0, 1, 2, 3, 4}),
    (dict(top_p=0.3), {3}),                 # .40 alone reaches .3
    (dict(top_p=0.5), {3, 1}),              # .40 < .5, .70 reaches it
    (dict(top_p=0.8), {3, 1, 4}),           # .70 < .8, .85 reaches it
    (dict(top_p=0.9), {3, 1, 4, 2}),
    (dict(top_p=1.0), {0, 1, 2, 3, 4}),
    (dict(min_p=0.3), {3, 1, 4}),           # keep p >= .3 * .40 = .12
    (dict(min_p=0.5), {3, 1}),              # keep p >= .20
    (dict(min_p=0.9), {3}),
    (dict(top_k=3, top_p=0.5), {3, 1}),
    (dict(top_k=1, top_p=0.9), {3}),
]


@pytest.mark.parametrize("kw,expected", FILTER_CASES, ids=[str(c[0]) for c in FILTER_CASES])
def test_filter_keeps_exactly_the_hand_computed_tokens(kw, expected):
    t = build([SamplingParams(**kw)])
    out = apply_filters(PROBS[None].clone(), t)
    assert kept(out[0]) == expected
    # kept tokens keep their probability (renormalisation is the sampler's business)
    assert torch.equal(out[0][sorted(expected)], PROBS[sorted(expected)])


def test_filters_apply_per_row_in_one_batch():
    perm = torch.randperm(5)                 # each row holds the probabilities in another order
    rows = [(dict(top_k=2), {3, 1}), (dict(), {0, 1, 2, 3, 4}), (dict(top_p=0.8), {3, 1, 4}),
            (dict(min_p=0.5), {3, 1})]
    probs = torch.stack([PROBS[perm] for _ in rows])
    inv = {int(p): i for i, p in enumerate(perm)}           # original token -> column
    out = apply_filters(probs, build([SamplingParams(**kw) for kw, _ in rows]))
    for r, (_, expected) in enumerate(rows):
        assert kept(out[r]) == {inv[t] for t in expected}, f"row {r}"


@pytest.mark.parametrize("kw,expected", [(dict(top_k=2), {3, 1}), (dict(top_p=0.8), {3, 1, 4}),
                                         (dict(min_p=0.5), {3, 1})])
def test_sampled_tokens_cover_exactly_the_kept_set(kw, expected):
    n = 2000
    logits = PROBS.log()[None].repeat(n, 1)
    t = build([SamplingParams(**kw)] * n, seeds=range(n))
    tokens, *_ = sample(logits, t)
    assert set(tokens.tolist()) == expected


# ---- the distribution ------------------------------------------------------------------------

def _draw_counts(logits: torch.Tensor, params: SamplingParams, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    seeds = torch.randint(0, 2 ** 40, (n,), generator=g).tolist()
    positions = torch.randint(0, 4096, (n,), generator=g).tolist()
    tokens, *_ = sample(logits[None].repeat(n, 1), build([params] * n, seeds, positions))
    return torch.bincount(tokens, minlength=logits.numel()).double()


def test_temperature_sampling_follows_the_softmax():
    logits = torch.randn(6, generator=torch.Generator().manual_seed(3)) * 1.5
    temp = 0.7
    counts = _draw_counts(logits, SamplingParams(temperature=temp), 20000, seed=11)
    target = torch.softmax(logits.double() / temp, -1)
    assert chi_square(counts, target) < CHI2_CRIT[5]
    # the test has power: the untempered softmax is rejected
    assert chi_square(counts, torch.softmax(logits.double(), -1)) > CHI2_CRIT[5]


def test_top_k_sampling_follows_the_renormalised_softmax():
    logits = torch.randn(6, generator=torch.Generator().manual_seed(4))
    counts = _draw_counts(logits, SamplingParams(temperature=1.0, top_k=3), 20000, seed=12)
    top = logits.topk(3).indices
    assert counts.sum() == counts[top].sum(), "a token outside the top 3 was drawn"
    target = torch.softmax(logits[top].double(), -1)
    assert chi_square(counts[top], target) < CHI2_CRIT[2]


def test_greedy_rows_take_the_argmax_in_a_mixed_batch():
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(5))
    params = [SamplingParams(temperature=0.0 if i % 2 == 0 else 1.0) for i in range(8)]
    tokens, *_ = sample(logits.clone(), build(params, seeds=range(8)))
    assert tokens[::2].tolist() == logits[::2].argmax(-1).tolist()


def test_banned_tokens_are_never_drawn():
    logits = torch.zeros(200, 5)
    logits[:, 2] = 10.0                                  # token 2 would almost always win
    t = build([SamplingParams(temperature=1.0)] * 200, seeds=range(200),
              banned=[(r, 2) for r in range(200)])
    with torch.inference_mode():          # as the runner hands them over
        logits = logits.clone()
    tokens, *_ = sample(logits, t)
    assert 2 not in tokens.tolist()
    assert (logits[:, 2] == 10.0).all(), "the caller's logits were modified"


def test_seeded_draw_does_not_depend_on_the_rest_of_the_batch():
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(5, 64, generator=g)
    mine = SamplingParams(temperature=0.9, seed=77)
    others = [SamplingParams(temperature=1.3), SamplingParams(temperature=0.0),
              SamplingParams(top_k=5), SamplingParams(top_p=0.5)]
    alone, *_ = sample(logits[2:3].clone(), build([mine], [77], [19]))
    params = others[:2] + [mine] + others[2:]
    batch, *_ = sample(logits.clone(), build(params, [1, 2, 77, 3, 4], [5, 6, 19, 7, 8]))
    assert batch[2] == alone[0]


def test_uniform_noise_is_a_pure_function_of_seed_position_and_token():
    seeds = torch.tensor([1, 1, 2, 1])
    pos = torch.tensor([7, 8, 7, 7])
    u = uniform_noise(seeds, pos, 1000)
    assert torch.equal(u[0], u[3])
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    assert torch.equal(uniform_noise(seeds[1:2], pos[1:2], 1000)[0], u[1])
    assert u.min() > 0 and u.max() < 1


def test_uniform_noise_is_uniform():
    u = uniform_noise(torch.arange(40), torch.arange(40) * 3, 1000).flatten()
    counts = torch.histc(u, bins=10, min=0, max=1).double()
    # df = 9, alpha = 0.001
    assert chi_square(counts, torch.full((10,), 0.1, dtype=torch.float64)) < 27.877


# ---- through the engine ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def llm(qwen3_dir):
    engine = LLM(qwen3_dir, device="cpu", block_size=4)
    yield engine
    engine.shutdown()


def sampled(n: int = 12, **kw) -> SamplingParams:
    return SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True, **kw)


def test_same_seed_gives_the_same_tokens_alone_or_in_a_batch(llm):
    prompt = random_prompts([9], seed=21)[0]
    a = llm.generate(prompt, sampled(seed=42))[0].token_ids
    b = llm.generate(prompt, sampled(seed=42))[0].token_ids
    others = random_prompts([4, 17, 6], seed=22)
    batch = llm.generate(others[:1] + [prompt] + others[1:],
                         [sampled(seed=1), sampled(seed=42), sampled(), sampled(top_k=3)])
    assert a == b == batch[1].token_ids


def test_different_seeds_give_different_tokens(llm):
    prompt = random_prompts([9], seed=23)[0]
    runs = [tuple(llm.generate(prompt, sampled(seed=s))[0].token_ids) for s in (1, 2, 3)]
    assert len(set(runs)) == 3


@pytest.fixture(scope="module")
def eos_is_first_greedy_token(qwen3_dir, tmp_path_factory):
    """A copy of the qwen3 checkpoint whose EOS is the first greedy token of `prompt`."""
    prompt = random_prompts([7], seed=24)[0]
    first = hf_greedy(qwen3_dir, [prompt])[0][0][0]
    path = tmp_path_factory.mktemp("eos") / "ckpt"
    shutil.copytree(qwen3_dir, path)
    with open(path / "generation_config.json", "w") as f:
        json.dump({"eos_token_id": [first]}, f)
    return str(path), prompt, first


def test_eos_ends_the_request_when_min_tokens_is_zero(eos_is_first_greedy_token):
    path, prompt, eos = eos_is_first_greedy_token
    with LLM(path, device="cpu") as engine:
        o = engine.generate(prompt, SamplingParams(temperature=0, max_tokens=12))[0]
    assert (o.token_ids, o.finish_reason) == ([eos], "stop")


def test_min_tokens_bans_eos_until_reached(eos_is_first_greedy_token):
    from tiny_models import load_hf
    path, prompt, eos = eos_is_first_greedy_token
    with LLM(path, device="cpu") as engine:
        eos_ids = sorted(engine.eos_token_ids)
        o = engine.generate(prompt, SamplingParams(temperature=0, max_tokens=12,
                                                   min_tokens=4))[0]
    assert eos in eos_ids
    assert not set(o.token_ids[:4]) & set(eos_ids)
    hf = load_hf(path)
    with torch.no_grad():
        ids = torch.tensor([prompt])     # an explicit mask: a token 0 is not padding
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, min_new_tokens=4,
                          do_sample=False, eos_token_id=eos_ids, pad_token_id=0)
    assert o.token_ids == ref[0, len(prompt):].tolist()
    assert o.finish_reason == ("stop" if o.token_ids[-1] in eos_ids else "length")


def test_stop_token_id_ends_the_request_at_its_first_occurrence(llm):
    prompt = random_prompts([8], seed=25)[0]
    full = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12,
                                               ignore_eos=True))[0].token_ids
    stop = full[3]
    o = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                            stop_token_ids=[stop]))[0]
    assert o.token_ids == full[:full.index(stop) + 1]
    assert o.finish_reason == "stop"


def test_stop_token_ids_are_banned_until_min_tokens(llm, qwen3_dir):
    from tiny_models import load_hf
    prompt = random_prompts([8], seed=26)[0]
    stop = hf_greedy(qwen3_dir, [prompt])[0][0][0]
    o = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                                            min_tokens=3, stop_token_ids=[stop]))[0]
    hf = load_hf(qwen3_dir)
    with torch.no_grad():
        ids = torch.tensor([prompt])     # an explicit mask: a token 0 is not padding
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, min_new_tokens=3,
                          do_sample=False, eos_token_id=[stop], pad_token_id=0)
    assert o.token_ids == ref[0, len(prompt):].tolist()
    assert stop not in o.token_ids[:3]


def _text_with_a_stop_candidate(llm):
    """A greedy reply and a 2-character stop string inside it (spanning two tokens)."""
    for seed in range(30, 40):
        prompt = random_prompts([6], seed=seed)[0]
        o = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16,
                                                ignore_eos=True))[0]
        text = o.text
        for a in range(2, len(text) - 2):
            s = text[a:a + 2]
            if "\ufffd" not in s and s.isprintable() and len(set(s)) == 2:
                return prompt, text, s
    pytest.fail("no greedy reply with a printable 2-character substring")


def test_stop_string_never_appears_in_text_or_stream(llm):
    prompt, full, stop = _text_with_a_stop_candidate(llm)
    expected = full[:full.find(stop)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[stop])
    o = llm.generate(prompt, params)[0]
    assert o.text == expected and o.finish_reason == "stop"
    events = list(llm.stream(prompt, params))
    assert all(stop not in e.text and stop not in e.output_text for e in events)
    assert "".join(e.text for e in events) == expected
    assert events[-1].finished and events[-1].finish_reason == "stop"


def test_held_back_stop_prefix_is_released_when_the_stop_never_completes(llm):
    prompt, full, stop = _text_with_a_stop_candidate(llm)
    c = stop[0]
    absent = next(c + x for x in "zqjxZQJX~" if c + x not in full)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[absent])
    events = list(llm.stream(prompt, params))
    assert "".join(e.text for e in events) == full
    assert events[-1].finish_reason == "length"


@pytest.mark.parametrize("k", [0, 1, 7])
def test_logprobs_k_gives_k_entries_per_token(llm, k):
    prompt = random_prompts([5], seed=27)[0]
    o = llm.generate(prompt, sampled(n=6, seed=5, logprobs=k))[0]
    if k == 0:
        assert o.logprobs == []
        return
    assert len(o.logprobs) == len(o.token_ids) == 6
    for tok, lp in zip(o.token_ids, o.logprobs):
        assert lp.token_id == tok and len(lp.top) == k
        vals = list(lp.top.values())
        assert vals == sorted(vals, reverse=True)
        assert lp.logprob <= vals[0] + 1e-6 and math.isfinite(lp.logprob)
        if tok in lp.top:
            assert lp.top[tok] == pytest.approx(lp.logprob, abs=1e-6)


def test_a_hash_of_all_ones_never_draws_a_banned_token():
    """Seed 682 at position 7 hashes token 2574 to all ones. The uniform must stay below 1: at
    u == 1, E = -log u = 0 and the race's p / E is 0 / 0 = NaN for a banned token (p = 0),
    which argmax picked (min_tokens bans EOS exactly like this)."""
    for logit in (0.0, 5.0):
        logits = torch.randn(1, 4096)
        logits[0, 2574] = logit
        st = SamplingTensors.build([SamplingParams(temperature=1.0)], [682], [7], [(0, 2574)],
                                   "cpu")
        tok, *_ = sample(logits, st)
        assert tok.item() != 2574
