"""Cascade decode attention (engine/kernels/cascade_attention.py) against the plain decode
reference: rows that share prefix blocks attend to them once, the result is the same attention.
The torch cascade (the CPU path) and the Triton kernels (the interpreter on a CPU) both."""
import pytest
import torch

from engine.kernels import cascade_attention as cascade
from engine.kernels import decode_attention as decode

NAN = float("nan")
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=4e-3, rtol=4e-3)}


def shared_batch(ctxs, grouped, shared_blocks, block_size, hkv, d, dtype, seed):
    """A NaN-poisoned paged cache where the rows in `grouped` share their first
    `shared_blocks` physical blocks (one copy of the prefix, as the prefix cache keeps it) and
    every other block is a row's own; unused table entries hold garbage."""
    g = torch.Generator().manual_seed(seed)
    cdiv = lambda a, b: -(-a // b)
    own = [cdiv(c, block_size) - (shared_blocks if i in grouped else 0) for i, c in enumerate(ctxs)]
    num_blocks = shared_blocks + sum(own) + 3
    ids = torch.randperm(num_blocks, generator=g)
    prefix, used = ids[:shared_blocks], shared_blocks
    width = max(cdiv(c, block_size) for c in ctxs) + 2
    tables = torch.full((len(ctxs), width), 10 ** 6, dtype=torch.int32)
    for i, c in enumerate(ctxs):
        head = prefix if i in grouped else ids[:0]
        row = torch.cat([head, ids[used:used + own[i]]])
        used += own[i]
        tables[i, :len(row)] = row.int()
    shape = (num_blocks, block_size, hkv, d)
    written = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    for i, c in enumerate(ctxs):
        t = torch.arange(c)
        written[tables[i, t // block_size].long(), t % block_size] = True
    k = torch.randn(shape, generator=g).to(dtype)
    v = torch.randn(shape, generator=g).to(dtype)
    k[~written], v[~written] = NAN, NAN          # a slot no row holds must never be read
    return k, v, tables


CASES = [  # (contexts, rows sharing the prefix, shared blocks, block size, hq, hkv, d)
    ([40, 37, 52, 9, 33], {0, 1, 2, 4}, 2, 16, 4, 2, 16),
    ([70, 70, 66, 90], {0, 1, 3}, 4, 16, 8, 2, 32),
    ([13, 29, 31, 17, 60, 21], {1, 2, 4}, 3, 8, 6, 2, 16),     # GQA 3
    ([24, 24], {0, 1}, 5, 4, 2, 2, 16),                          # MHA, a one-token suffix
]


@pytest.mark.parametrize("ctxs,grouped,shared_blocks,bs,hq,hkv,d", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_torch_cascade_equals_plain_attention(ctxs, grouped, shared_blocks, bs, hq, hkv, d,
                                              dtype):
    k, v, tables = shared_batch(ctxs, grouped, shared_blocks, bs, hkv, d, dtype, seed=len(ctxs))
    q = torch.randn(len(ctxs), hq, d).to(dtype)
    ctx = torch.tensor(ctxs, dtype=torch.int32)
    first = torch.tensor([shared_blocks * bs if i in grouped else 0 for i in range(len(ctxs))],
                         dtype=torch.int32)
    plain = decode.paged_decode_attention_ref(q, k, v, tables, ctx, 0.2)
    got = cascade.cascade_decode_attention_ref(q, k, v, tables, ctx, 0.2, first, min(grouped))
    torch.testing.assert_close(got.float(), plain.float(), **TOL[dtype])


@pytest.mark.parametrize("ctxs,grouped,shared_blocks,bs,hq,hkv,d", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("prefix_splits", [1, 3])
def test_cascade_kernels_equal_plain_attention(ctxs, grouped, shared_blocks, bs, hq, hkv, d,
                                               dtype, prefix_splits, monkeypatch,
                                               triton_interpreter):
    """Twice through the same workspace (the arrival counters are reset by each merge), with
    the prefix split over 1 or several programs and the suffix's own splits."""
    monkeypatch.setattr(cascade, "choose_prefix_splits", lambda *a: prefix_splits)
    monkeypatch.setattr(cascade, "BLOCK_M", 16)     # several row tiles at these small shapes
    k, v, tables = shared_batch(ctxs, grouped, shared_blocks, bs, hkv, d, dtype, seed=7)
    ctx = torch.tensor(ctxs, dtype=torch.int32)
    first = torch.tensor([shared_blocks * bs if i in grouped else 0 for i in range(len(ctxs))],
                         dtype=torch.int32)
    inputs = cascade.CascadeInputs(first, torch.tensor([min(grouped)], dtype=torch.int32),
                                   shared_blocks * bs)
    for _ in range(2):
        q = torch.randn(len(ctxs), hq, d).to(dtype)
        plain = decode.paged_decode_attention_ref(q, k, v, tables, ctx, 0.2)
        out = cascade.cascade_decode_attention(q, k, v, tables, ctx, 0.2, inputs,
                                               out=torch.full_like(q, NAN))
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out.float(), plain.float(), **TOL[dtype])


def test_a_cascade_with_no_row_in_the_group_is_plain_attention(triton_interpreter):
    k, v, tables = shared_batch([20, 30], set(), 0, 16, 2, 16, torch.float32, seed=3)
    ctx = torch.tensor([20, 30], dtype=torch.int32)
    zero = torch.zeros(2, dtype=torch.int32)
    q = torch.randn(2, 4, 16)
    out = cascade.cascade_decode_attention(q, k, v, tables, ctx, 0.2, cascade.CascadeInputs(
        zero, torch.zeros(1, dtype=torch.int32), 16))
    torch.testing.assert_close(out, decode.paged_decode_attention_ref(q, k, v, tables, ctx, 0.2),
                               **TOL[torch.float32])


# ---- the per-step decision (engine/cascade.py) ---------------------------------------------
def test_the_plan_groups_rows_whose_tables_start_alike_and_counts_only_full_older_blocks():
    import numpy as np
    from engine.cascade import plan_cascade
    # rows 0, 2, 3 share blocks 7, 8, 9; row 3 diverges after 7, 8; row 1 is alone
    tables = np.array([[7, 8, 9, 10], [1, 2, 3, -1], [7, 8, 9, 11], [7, 8, 5, 6]], np.int32)
    ctx = np.array([16, 12, 15, 16], np.int32)
    plan = plan_cascade(tables, ctx, 4, min_saved=1)
    assert (plan.rows, plan.shared_tokens) == (3, 8)          # blocks 7, 8: the common run
    assert plan.first.tolist() == [8, 0, 8, 8] and plan.lead in (0, 2, 3)
    # a block holding a row's newest token is this step's own K/V: never shared
    plan = plan_cascade(tables[:3], np.array([9, 12, 9], np.int32), 4, min_saved=1)
    assert plan.shared_tokens == 8 and plan.first.tolist() == [8, 0, 8]
    plan = plan_cascade(tables[:3], np.array([8, 12, 8], np.int32), 4, min_saved=1)
    assert plan.shared_tokens == 4
    # too few reads saved to pay for the extra launch: no cascade
    assert plan_cascade(tables, ctx, 4, min_saved=17) is None
    assert plan_cascade(tables[[0, 1]], ctx[[0, 1]], 4, min_saved=1) is None
    assert plan_cascade(tables, ctx, 4, min_saved=0) is None          # 0: off


def test_the_engine_reads_a_shared_prefix_once_and_gives_the_plain_tokens(qwen3_dir):
    """Rows sharing a cached prompt prefix decode through the cascade: the same tokens and
    logprobs as the plain kernel, and the step's trace says what it saved."""
    import numpy as np
    from engine import LLM, SamplingParams
    rng = np.random.default_rng()
    prefix = rng.integers(3, 190, 40).tolist()
    prompts = [prefix + rng.integers(3, 190, int(n)).tolist() for n in rng.integers(1, 9, 4)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)

    def run(min_saved):
        with LLM(qwen3_dir, device="cpu", block_size=4,
                 kernels={"cascade_min_saved_tokens": min_saved}) as llm:
            llm.generate([prefix], SamplingParams(temperature=0, max_tokens=1))  # cache it
            outs = llm.generate(prompts, params)
            return outs, llm.inspect().steps

    plain, plain_steps = run(0)
    casc, steps = run(16)
    assert not any(s.cascade_rows for s in plain_steps)
    used = [s for s in steps if s.cascade_rows]
    assert used, "no decode step used the cascade"
    assert all(s.cascade_rows == 4 and s.cascade_tokens == 40 and s.kv_bytes_saved > 0
               for s in used)
    for a, b in zip(plain, casc):
        assert a.token_ids == b.token_ids
        np.testing.assert_allclose([x.logprob for x in a.logprobs],
                                   [x.logprob for x in b.logprobs], atol=1e-5)
