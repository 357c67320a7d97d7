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
