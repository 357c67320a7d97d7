"""The grammar's token bitmask applied to logits: exactly the allowed tokens keep their logit."""
from __future__ import annotations

import numpy as np
import torch

from engine.guided import apply_bitmask


def test_bitmask_keeps_exactly_the_allowed_tokens():
    rng = np.random.default_rng()
    v = 75                                   # not a multiple of 32: the last word is partial
    allowed = rng.random((3, v)) < 0.3
    words = np.zeros((3, (v + 31) // 32), dtype=np.int64)
    for r, t in zip(*np.nonzero(allowed)):
        words[r, t // 32] |= 1 << (t % 32)
    mask = torch.from_numpy(words.astype(np.uint32).view(np.int32))
    logits = torch.randn(3, v)
    got = apply_bitmask(logits, mask)
    want = logits.masked_fill(~torch.from_numpy(allowed), float("-inf"))
    assert torch.equal(got, want)


def test_an_all_ones_row_is_untouched():
    logits = torch.randn(2, 40)
    mask = torch.full((2, 2), -1, dtype=torch.int32)
    assert torch.equal(apply_bitmask(logits, mask), logits)


# ---- the engine's mask buffers and late masks -----------------------------------------------
import json  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

DEMO = str(Path(__file__).resolve().parents[1] / "assets" / "demo-qwen3")
SCHEMA = {"type": "object", "properties": {
    "n": {"type": "integer", "minimum": 0, "maximum": 10**6},
    "tags": {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 4}}},
    "required": ["n", "tags"], "additionalProperties": False}     # at most ~50 tokens


@pytest.fixture(scope="module")
def demo_tokenizer():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(DEMO)


def _grammar(tok):
    from engine.guided import grammar_of, make_matcher
    return make_matcher(tok, len(tok), {tok.eos_token_id}, grammar_of({"json_schema": SCHEMA}))


def test_reused_mask_buffers_equal_llguidance_fill_step_after_step(demo_tokenizer):
    from llguidance.torch import fill_next_token_bitmask
    from engine.grammar_masks import GrammarMasks
    rng = np.random.default_rng()
    ours, ref = _grammar(demo_tokenizer), _grammar(demo_tokenizer)
    masks = GrammarMasks(pin=False)
    text = json.dumps({"n": int(rng.integers(0, 10**6)), "tags": ["a", "bc"]},
                      separators=(",", ":"))
    for tok in demo_tokenizer.encode(text, add_special_tokens=False):
        got = masks.fill([None, ours, None])
        want = torch.zeros(1, got.shape[1], dtype=torch.int32)
        fill_next_token_bitmask(ref.matcher, want, 0)
        assert (got[0] == -1).all() and (got[2] == -1).all(), "an unguided row was masked"
        assert np.array_equal(got[1], want[0].numpy())
        bits = np.unpackbits(want[0].numpy().view(np.uint8)).sum()
        assert ours.num_allowed == bits < ours.vocab_size
        ours.consume(tok)
        ref.consume(tok)


def test_consuming_the_same_token_twice_advances_once(demo_tokenizer):
    g = _grammar(demo_tokenizer)
    first = demo_tokenizer.encode("{", add_special_tokens=False)[0]
    g.consume_at(0, first)
    g.consume_at(0, first)          # the postprocess after a late mask's early advance
    assert g.num_consumed == 1
    with pytest.raises(RuntimeError):
        g.consume_at(3, first)      # skipping a token is a bug, not a refusal


@pytest.mark.parametrize("late", [True, False])
def test_overlap_keeps_guided_tokens_identical_to_serial(late):
    """Sampled with seeds: a mask one token stale (or the grammar advanced twice) changes the
    draws or breaks the JSON. late=False is the TP path (the core drains instead)."""
    from engine import LLM, SamplingParams
    params = [SamplingParams(seed=int(s), max_tokens=200, guided={"json_schema": SCHEMA})
              for s in np.random.default_rng().integers(0, 2**31, 3)]
    params.append(SamplingParams(seed=5, max_tokens=12))            # unguided beside them
    outs = {}
    for overlap in (False, True):
        with LLM(DEMO, device="cpu", dtype="float32", num_kv_blocks=64,
                 async_scheduling=overlap) as llm:
            llm.core.late_masks = late and overlap
            outs[overlap] = llm.generate(["a", "b", "c", "d"], params)
            steps = llm.inspect().steps
        if overlap:
            assert any(len(s.entries) > 1 for s in steps)
    for a, b in zip(outs[False], outs[True]):
        assert a.token_ids == b.token_ids
    for o in outs[True][:3]:
        obj = json.loads(o.text)
        assert set(obj) == {"n", "tags"} and isinstance(obj["n"], int)


def _random_mask(g, B, words):
    # every bit pattern, bit 31 (int32's sign) included
    return torch.randint(-(1 << 31), 1 << 31, (B, words), generator=g, dtype=torch.int64).to(
        torch.int32)


def test_the_bitmask_kernel_equals_its_torch_reference(triton_interpreter):
    from engine.guided import apply_bitmask_ref
    from engine.kernels.bitmask_kernel import apply_bitmask_kernel
    g = torch.Generator().manual_seed(int(np.random.SeedSequence().entropy % 2**31))
    B, V = 3, 1000                      # not a multiple of 32 nor of the block
    logits = torch.randn(B, V, generator=g) * 4
    for words in ((V + 31) // 32, 20):  # full width, and a mask narrower than the vocabulary
        mask = _random_mask(g, B, words)
        want = apply_bitmask_ref(logits, mask)
        got = apply_bitmask_kernel(logits, mask, block=256)
        assert torch.equal(got, want)
        bits = ((mask[:, :, None].long() >> torch.arange(32)) & 1).reshape(B, -1)[:, :V].bool()
        if words * 32 < V:
            bits = torch.nn.functional.pad(bits, (0, V - words * 32))
        assert torch.equal(torch.isinf(got), ~bits), "a token's bit and its -inf disagree"
        assert torch.equal(got[bits], logits[bits])
