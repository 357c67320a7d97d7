"""bench/moe.py's bandwidth floor: the bytes a MoE run's steps must read, from step traces
(no engine)."""
from types import SimpleNamespace

import numpy as np
import pytest

from bench.moe import ModelBytes, expected_experts, run_floor, step_bytes

MB = ModelBytes(expert=1000, num_experts=128, top_k=8, moe_layers=2, dense=50_000, embed_row=10,
                kv_per_token=7)


def _step(prefill: int, decode: list[int], load=None):
    """A StepTrace stand-in: one prefill chunk of `prefill` tokens from position 0, and decode
    entries at the given positions."""
    entries = ([SimpleNamespace(start_pos=0, num_tokens=prefill)] if prefill else []) + \
        [SimpleNamespace(start_pos=p, num_tokens=1) for p in decode]
    return SimpleNamespace(num_prefill_tokens=prefill, num_decode_tokens=len(decode),
                           entries=entries, expert_load=load)


def test_expected_experts_follows_uniform_routing():
    assert expected_experts(1, 128, 8) == pytest.approx(8)
    assert expected_experts(2, 128, 8) == pytest.approx(8 + 8 * (1 - 8 / 128))
    assert expected_experts(4096, 128, 8) == pytest.approx(128)


def test_step_bytes_are_experts_hit_dense_weights_and_the_kv_attended():
    step = _step(0, [99, 9])      # two decode tokens over contexts of 100 and 10
    expert, dense, kv = step_bytes(step, MB, counted=False)
    assert expert == pytest.approx(2 * expected_experts(2, 128, 8) * 1000)
    assert dense == 50_000 + 2 * 10
    assert kv == (100 + 10) * 7


def test_counted_experts_come_from_the_expert_load_and_ignore_unhit_experts():
    load = np.zeros((2, 128))
    load[0, [1, 2, 3]] = [2, 1, 1]
    load[1, 5] = 4
    expert, _, _ = step_bytes(_step(0, [1, 2, 3, 4], load), MB, counted=True)
    assert expert == 4 * 1000
    uniform, _, _ = step_bytes(_step(0, [1, 2, 3, 4], load), MB, counted=False)
    assert uniform == pytest.approx(2 * expected_experts(4, 128, 8) * 1000)


def test_run_floor_sums_the_steps_over_the_bandwidth():
    steps = [_step(30, []), _step(0, [30]), _step(0, [31, 5])]
    f = run_floor(steps, MB, copy_bw=1e6)
    total = sum(sum(step_bytes(s, MB, False)) for s in steps)
    assert f["seconds"] == pytest.approx(total / 1e6)
    assert (f["steps"], f["decode_steps"], f["mean_decode_batch"]) == (3, 2, 1.5)
    assert f["expert_bytes"] + f["dense_bytes"] + f["kv_bytes"] == pytest.approx(total)
    assert not f["counted"]
