"""The prefill graph's static-buffer layout (engine/prefill_graphs.pack_prefill_inputs), on the
CPU: real rows where they belong, padding that writes nothing and attends to nothing."""
from __future__ import annotations

import numpy as np

from engine.prefill_graphs import pack_prefill_inputs, token_buckets
from engine.step_inputs import StepInputs


def make_inputs(rng, q_lens, ctx_extra, nb):
    N = sum(q_lens)
    return StepInputs(
        step_id=3, input_ids=rng.integers(1, 1000, N), positions=rng.integers(0, 500, N),
        slot_mapping=rng.integers(0, 9000, N),
        context_lens=np.array([q + c for q, c in zip(q_lens, ctx_extra)], np.int32),
        block_tables=rng.integers(1, 600, (len(q_lens), nb)).astype(np.int32),
        cu_seqlens_q=np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32),
        max_seqlen_q=max(q_lens), sample_rows=np.cumsum(q_lens) - 1, is_decode=False,
        sampling=None, pending_rows=np.array([N - 1]), pending_src=np.array([0]))


def test_pack_prefill_inputs_lays_out_real_rows_and_harmless_padding():
    rng = np.random.default_rng(0)
    q_lens, T, S, maxb, maxt = [7, 1, 20], 32, 4, 9, 64
    inp = make_inputs(rng, q_lens, [0, 40, 16], 5)
    a64 = np.full(3 * maxt + S + 2, 777, np.int64)
    a32 = np.full(2 * S + 1 + 3 * maxb, 777, np.int32)
    pack_prefill_inputs(inp, maxt, T, S, maxb, a64, a32)
    N = sum(q_lens)
    ids, pos, slots = a64[:3 * maxt].reshape(3, maxt)
    assert (ids[:N] == inp.input_ids).all() and (pos[:N] == inp.positions).all()
    assert (slots[:N] == inp.slot_mapping).all()
    assert (ids[N:T] == 0).all() and (pos[N:T] == 0).all() and (slots[N:T] == -1).all()
    base = 3 * maxt
    assert a64[base:base + 3].tolist() == inp.sample_rows.tolist() and a64[base + 3] == 0
    assert a64[base + S:].tolist() == [N - 1, 0]
    cu, ctx = a32[:S + 1], a32[S + 1:2 * S + 1]
    assert cu.tolist() == [0, 7, 8, 28, 28]           # the padded sequence: q_len 0
    assert ctx.tolist() == [7, 41, 36, 0]             # and context 0
    tables = a32[2 * S + 1:].reshape(3, maxb)
    assert (tables[:, :5] == inp.block_tables).all()


def test_pack_prefill_inputs_holds_a_verify_steps_sample_rows():
    """A speculative verify samples 1 + k rows of one sequence: more sample rows (R) than
    sequences (S); the pending rows follow the R sample rows."""
    rng = np.random.default_rng(1)
    q_lens, T, S, R, maxb, maxt = [5, 1], 16, 4, 12, 9, 32
    inp = make_inputs(rng, q_lens, [30, 8], 4)
    inp.sample_rows = np.array([0, 1, 2, 3, 4, 5])
    a64 = np.full(3 * maxt + R + 2, 777, np.int64)
    a32 = np.full(2 * S + 1 + 2 * maxb, 777, np.int32)
    pack_prefill_inputs(inp, maxt, T, S, maxb, a64, a32, R)
    base = 3 * maxt
    assert a64[base:base + R].tolist() == [0, 1, 2, 3, 4, 5] + [0] * 6
    assert a64[base + R:].tolist() == [5, 0]
    assert a32[:S + 1].tolist() == [0, 5, 6, 6, 6]


def test_token_buckets_stop_at_the_step_budget():
    assert token_buckets(8192)[-1] == 2048
    assert token_buckets(512)[-1] == 512 and 1024 not in token_buckets(512)
    assert token_buckets(8) == [16]


def test_smallest_bucket_is_the_first_that_holds_n():
    from engine.cuda_graphs import graph_buckets, smallest_bucket
    buckets = graph_buckets(256)
    for n in range(1, 258):
        want = min((b for b in buckets if b >= n), default=None)
        assert smallest_bucket(buckets, n) == want
