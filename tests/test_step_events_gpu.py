"""The step events' ring (engine/step_output.py): reused only once a step is done, never while
pending, and every step still gets its own GPU time."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from engine import LLM, SamplingParams  # noqa: E402
from engine.step_output import RING, StepEvents  # noqa: E402


def test_a_pending_triple_is_replaced_not_recorded_again():
    ev = StepEvents(torch.device("cuda"))
    s = ev.stream()
    first = ev.take()
    torch.cuda._sleep(200_000_000)          # keep the stream busy well past the next takes
    for e in first:
        e.record(s)
    assert not first[2].query()
    seen = [ev.take() for _ in range(RING - 1)]
    again = ev.take()                        # the ring came round to the pending triple
    assert again is not first and not any(a is b for a, b in zip(again, first))
    assert all(t[2].query() for t in seen)
    torch.cuda.synchronize()
    later = [ev.take() for _ in range(RING)]
    assert any(t is again for t in later)    # done now: it is reused


def test_every_step_keeps_its_own_gpu_time_across_many_reuses(model_factory):
    llm = LLM(model_factory("qwen3"), device="cuda", dtype="float32", num_kv_blocks=256,
              block_size=16, max_num_seqs=4)
    try:
        sp = SamplingParams(temperature=0, max_tokens=5 * RING, ignore_eos=True)
        llm.generate([list(range(3, 40)), list(range(50, 60))], sp)
        steps = llm.inspect().steps
        assert len(steps) > 3 * RING
        fwd = [s.t_forward for s in steps]
        assert all(0 < t < 1.0 for t in fwd)
        # a prefill step of 37 + 10 tokens against one-token decode steps: the times are the
        # steps' own, not a reused event's later reading
        assert steps[0].num_prefill_tokens > 0
    finally:
        llm.shutdown()
