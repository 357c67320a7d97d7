"""GPU: every Triton kernel against its torch reference in bf16 at Qwen shapes, and paged decode
attention and the fused q/k-norm + RoPE + K/V store replayed from CUDA graphs after their
inputs change in place."""
import pytest
import torch

from engine.kernels import decode_attention
from engine.kernels.activation import silu_and_mul, silu_and_mul_ref
from engine.kernels.attention_probe import attention_probs, attention_probs_ref
from engine.kernels.decode_attention import paged_decode_attention, paged_decode_attention_ref
from engine.kernels.prefill_attention import paged_prefill_attention, paged_prefill_attention_ref
from engine.kernels.qk_norm_rope_store import qk_norm_rope_store, qk_norm_rope_store_ref
from engine.kernels.rmsnorm import fused_add_rms_norm, fused_add_rms_norm_ref, rms_norm, rms_norm_ref
from engine.kernels.rotary import apply_rotary, apply_rotary_ref, build_cos_sin_cache
from engine.kernels.store_kvcache import store_kvcache, store_kvcache_ref

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

BF16 = torch.bfloat16
HEAD_DIM = 128
HEADS = [(16, 8), (32, 4)]  # (query heads, kv heads): Qwen3-0.6B and Qwen3-30B-A3B
BLOCK_SIZES = [16, 32]
# bf16 keeps 8 mantissa bits; attention also rounds the probabilities to bf16 before P @ V
ATTN_REL_TOL = 2e-2
NAN = float("nan")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    with torch.device("cuda"):
        yield


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def assert_rows_close(out: torch.Tensor, ref: torch.Tensor, rel_tol: float) -> None:
    """Relative L2 error per row of the last dim (one head of one token), worst row reported."""
    diff = (out.float() - ref.float()).norm(dim=-1)
    scale = ref.float().norm(dim=-1).clamp_min(1e-6)
    worst = (diff / scale).max().item()
    assert torch.isfinite(out).all(), "non-finite values in the kernel output"
    assert worst < rel_tol, f"worst row relative error {worst:.3e} >= {rel_tol}"


def paged_cache(ctxs, block_size, num_kv_heads, spare_blocks=8):
    """Random bf16 K/V cache and shuffled block tables; unused entries hold -1 or garbage ids."""
    num_blocks = sum(_cdiv(c, block_size) for c in ctxs) + spare_blocks
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, HEAD_DIM, dtype=BF16)
    v_cache = torch.randn_like(k_cache)
    ids = torch.randperm(num_blocks, dtype=torch.int32)
    tables = torch.full((len(ctxs), max(_cdiv(c, block_size) for c in ctxs) + 4), -1, dtype=torch.int32)
    used = 0
    for b, ctx in enumerate(ctxs):
        n = _cdiv(ctx, block_size)
        tables[b, :n] = ids[used:used + n]
        tables[b, n:] = -1 if b % 2 else 10**7
        used += n
    return k_cache, v_cache, tables


# ---------------------------------------------------------------- elementwise kernels

@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("num_kv_heads", [8, 4])
def test_store_kvcache_matches_ref(block_size, num_kv_heads):
    n, num_blocks = 1000, 80
    qkv = torch.randn(n, (16 + 2 * num_kv_heads) * HEAD_DIM, dtype=BF16)
    key = qkv[:, 16 * HEAD_DIM:(16 + num_kv_heads) * HEAD_DIM].view(n, num_kv_heads, HEAD_DIM)
    value = qkv[:, (16 + num_kv_heads) * HEAD_DIM:].view(n, num_kv_heads, HEAD_DIM)
    slots = torch.randperm(num_blocks * block_size)[:n]
    slots[::7] = -1
    got = torch.full((2, num_blocks, block_size, num_kv_heads, HEAD_DIM), NAN, dtype=BF16)
    want = got.clone()
    store_kvcache(key, value, got[0], got[1], slots.int())
    store_kvcache_ref(key, value, want[0], want[1], slots)
    assert torch.equal(got.nan_to_num(3.0), want.nan_to_num(3.0))


@pytest.mark.parametrize("num_tokens", [1, 7, 1024])
def test_rms_norm_and_fused_add_match_ref(num_tokens):
    x, residual = torch.randn(2, num_tokens, 1024, dtype=BF16)
    w = torch.randn(1024, dtype=BF16)
    torch.testing.assert_close(rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6), atol=2e-2, rtol=2e-2)
    out, res = fused_add_rms_norm(x, residual, w, 1e-6)
    ref_out, ref_res = fused_add_rms_norm_ref(x, residual, w, 1e-6)
    assert torch.equal(res, ref_res)
    torch.testing.assert_close(out, ref_out, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("num_q_heads,num_kv_heads", HEADS)
def test_qk_rms_norm_on_strided_head_rows_matches_ref(num_q_heads, num_kv_heads):
    n = 300
    qkv = torch.randn(n, (num_q_heads + 2 * num_kv_heads) * HEAD_DIM, dtype=BF16)
    q = qkv[:, :num_q_heads * HEAD_DIM].view(n, num_q_heads, HEAD_DIM)
    w = torch.randn(HEAD_DIM, dtype=BF16)
    torch.testing.assert_close(rms_norm(q, w, 1e-6), rms_norm_ref(q, w, 1e-6), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("num_q_heads,num_kv_heads", HEADS)
def test_rotary_matches_ref(num_q_heads, num_kv_heads):
    n = 1000
    cache = build_cos_sin_cache(HEAD_DIM, 4096, 1e6, "cuda")
    positions = torch.randint(0, 4096, (n,))
    qkv = torch.randn(n, (num_q_heads + 2 * num_kv_heads) * HEAD_DIM, dtype=BF16)
    q = qkv[:, :num_q_heads * HEAD_DIM].view(n, num_q_heads, HEAD_DIM)
    k = qkv[:, num_q_heads * HEAD_DIM:(num_q_heads + num_kv_heads) * HEAD_DIM].view(n, num_kv_heads, HEAD_DIM)
    ref_q, ref_k = apply_rotary_ref(q.clone(), k.clone(), positions, cache)
    got_q, got_k = apply_rotary(q, k, positions, cache)
    torch.testing.assert_close(got_q, ref_q, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got_k, ref_k, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("num_tokens", [1, 1024])
def test_silu_and_mul_matches_ref(num_tokens):
    x = torch.randn(num_tokens, 2 * 3072, dtype=BF16)
    torch.testing.assert_close(silu_and_mul(x), silu_and_mul_ref(x), atol=2e-2, rtol=2e-2)


# ---------------------------------------------------------------- fused q/k norm + RoPE + K/V store

ROPE_POSITIONS = 40976  # Qwen3's table length


def _unfused_qk_norm_rope_store(qkv, positions, cache, k_cache, v_cache, slots, hq, hkv, q_w, k_w):
    """The four launches the fused kernel replaces, as QwenAttention ran them on the GPU."""
    n, d = qkv.shape[0], cache.shape[-1]
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], -1)
    q, k, v = q.reshape(n, hq, d), k.reshape(n, hkv, d), v.reshape(n, hkv, d)
    if q_w is not None:
        q = rms_norm(q.reshape(-1, d), q_w, 1e-6).view(n, hq, d)
        k = rms_norm(k.reshape(-1, d), k_w, 1e-6).view(n, hkv, d)
    else:
        q, k = q.clone(), k.clone()
    q, k = apply_rotary(q, k, positions, cache)
    store_kvcache(k, v, k_cache, v_cache, slots)
    return q


# (Hq, Hkv, D): Qwen3-0.6B, Qwen3-30B-A3B, Qwen2.5-0.5B (14 query heads: not a power of 2)
FUSED_SHAPES = [(16, 8, 128), (32, 4, 128), (14, 2, 64)]


@pytest.mark.parametrize("dtype", [BF16, torch.float32])
@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim", FUSED_SHAPES)
@pytest.mark.parametrize("qk_norm", [True, False])
@pytest.mark.parametrize("num_tokens", [1, 7, 1000])
def test_qk_norm_rope_store_matches_the_unfused_kernels(dtype, num_q_heads, num_kv_heads, head_dim,
                                                        qk_norm, num_tokens):
    """fp32: against the four launches it replaces, bit for bit without q/k norm and within an
    ulp or two with it (the fused kernel's sum of squares adds in another order than the
    rms_norm kernel's, as the H200 showed); bf16: within bf16 rounding of them and of the torch
    reference."""
    n, block_size, num_blocks = num_tokens, 16, 80
    width = (num_q_heads + 2 * num_kv_heads) * head_dim
    qkv = (torch.randn(n, width + 64) * 2).to(dtype)[:, 64:]   # a strided projection output
    positions = torch.randint(0, ROPE_POSITIONS, (n,))
    positions[0] = ROPE_POSITIONS - 1
    slots = torch.randperm(num_blocks * block_size)[:n]
    slots[1::5] = -1
    q_w = torch.randn(head_dim).to(dtype) if qk_norm else None
    k_w = torch.randn(head_dim).to(dtype) if qk_norm else None
    cache = build_cos_sin_cache(head_dim, ROPE_POSITIONS, 1e6, "cuda")
    kv = {name: torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), NAN, dtype=dtype)
          for name in ("fused", "unfused", "ref")}
    q = qk_norm_rope_store(qkv, positions, cache, kv["fused"][0], kv["fused"][1], slots,
                           num_q_heads, num_kv_heads, q_w, k_w, 1e-6)
    want_q = _unfused_qk_norm_rope_store(qkv, positions, cache, kv["unfused"][0], kv["unfused"][1],
                                         slots, num_q_heads, num_kv_heads, q_w, k_w)
    ref_q = qk_norm_rope_store_ref(qkv, positions, cache, kv["ref"][0], kv["ref"][1], slots,
                                   num_q_heads, num_kv_heads, q_w, k_w, 1e-6)
    live = slots >= 0
    flat = {name: c.view(2, -1, num_kv_heads, head_dim)[:, slots[live]] for name, c in kv.items()}
    assert kv["fused"].isnan().all(-1).all(-1).sum().item() == 2 * (num_blocks * block_size - live.sum().item())
    if dtype == torch.float32 and not qk_norm:
        assert torch.equal(q, want_q)
        assert torch.equal(flat["fused"], flat["unfused"])
    elif dtype == torch.float32:
        torch.testing.assert_close(q, want_q, rtol=4e-7, atol=1e-6)
        torch.testing.assert_close(flat["fused"], flat["unfused"], rtol=4e-7, atol=1e-6)
    else:
        assert_rows_close(q, want_q, 2**-8)
        assert_rows_close(flat["fused"], flat["unfused"], 2**-8)
    assert_rows_close(q, ref_q, 2e-2)
    assert_rows_close(flat["fused"], flat["ref"], 2e-2)


def test_qk_norm_rope_store_replays_from_a_cuda_graph_with_new_probe_rows():
    """The probe's q-row index is read on the device: a captured launch copies whichever row
    the index names at replay, with new positions, slots and inputs."""
    n, hq, hkv, d, block_size, num_blocks = 8, 16, 8, 128, 16, 64
    qkv = torch.randn(n, (hq + 2 * hkv) * d, dtype=BF16)
    positions = torch.randint(0, ROPE_POSITIONS, (n,))
    slots = torch.randperm(num_blocks * block_size)[:n]
    q_w, k_w = torch.randn(2, d, dtype=BF16)
    cache = build_cos_sin_cache(d, ROPE_POSITIONS, 1e6, "cuda")
    k_cache = torch.zeros(num_blocks, block_size, hkv, d, dtype=BF16)
    v_cache = torch.zeros_like(k_cache)
    probe_rows = torch.tensor([0], dtype=torch.int64)
    probe_q = torch.zeros(1, hq, d, dtype=BF16)
    q_out = torch.empty(n, hq, d, dtype=BF16)

    def launch():
        qk_norm_rope_store(qkv, positions, cache, k_cache, v_cache, slots, hq, hkv, q_w, k_w, 1e-6,
                           probe_rows=probe_rows, probe_q=probe_q, q_out=q_out)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile before capture
        launch()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch()

    for row in (5, 0, 7, -1):
        qkv.copy_(torch.randn_like(qkv))
        positions.copy_(torch.randint(0, ROPE_POSITIONS, (n,)))
        slots.copy_(torch.randperm(num_blocks * block_size)[:n])
        probe_rows.fill_(row)
        probe_q.fill_(NAN)
        graph.replay()
        torch.cuda.synchronize()
        kv = torch.zeros(2, num_blocks, block_size, hkv, d, dtype=BF16)
        want = _unfused_qk_norm_rope_store(qkv, positions, cache, kv[0], kv[1], slots, hq, hkv, q_w, k_w)
        assert_rows_close(q_out, want, 2**-8)
        if row >= 0:
            assert torch.equal(probe_q[0], q_out[row])
        else:
            assert probe_q.isnan().all()


# ---------------------------------------------------------------- attention

DECODE_CTXS = [1, 2, 15, 17, 31, 33, 100, 257, 400, 0, 1000, 2047, 4095, 4096]  # 0 = padding row


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("num_q_heads,num_kv_heads", HEADS)
@pytest.mark.parametrize("num_splits", [None, 1, 8])
def test_decode_attention_matches_ref(block_size, num_q_heads, num_kv_heads, num_splits):
    k_cache, v_cache, tables = paged_cache(DECODE_CTXS, block_size, num_kv_heads)
    ctx = torch.tensor(DECODE_CTXS, dtype=torch.int32)
    q = torch.randn(len(DECODE_CTXS), num_q_heads, HEAD_DIM, dtype=BF16)
    out = paged_decode_attention(q, k_cache, v_cache, tables, ctx, HEAD_DIM**-0.5,
                                 out=torch.full_like(q, NAN), num_splits=num_splits)
    ref = paged_decode_attention_ref(q, k_cache, v_cache, tables, ctx, HEAD_DIM**-0.5)
    live = ctx > 0
    assert (out[~live] == 0).all()
    assert_rows_close(out[live], ref[live], ATTN_REL_TOL)


@pytest.mark.parametrize("num_q_heads,num_kv_heads", HEADS + [(28, 4)])  # + Qwen2.5-7B: GQA 7
@pytest.mark.parametrize("num_splits,bound", [(32, None), (17, None), (None, 512), (None, 256)])
def test_decode_attention_merge_and_context_bound_match_ref(num_q_heads, num_kv_heads,
                                                            num_splits, bound):
    """The in-kernel merge of a query-head group (all heads at once, in chunks of splits) with
    many splits, and the split count a graph's context bound picks, in bf16 against the
    reference; contexts up to the bound (bound None: up to 4,096)."""
    ctxs = [c for c in DECODE_CTXS if bound is None or c <= bound]
    k_cache, v_cache, tables = paged_cache(ctxs, 16, num_kv_heads)
    tables = torch.nn.functional.pad(tables, (0, 257 - tables.shape[1]), value=0)  # the graph width
    ctx = torch.tensor(ctxs, dtype=torch.int32)
    for _ in range(2):          # twice: the arrival counters are reset by each merge
        q = torch.randn(len(ctxs), num_q_heads, HEAD_DIM, dtype=BF16)
        out = paged_decode_attention(q, k_cache, v_cache, tables, ctx, HEAD_DIM**-0.5,
                                     out=torch.full_like(q, NAN), num_splits=num_splits,
                                     max_context=bound)
        ref = paged_decode_attention_ref(q, k_cache, v_cache, tables, ctx, HEAD_DIM**-0.5)
        live = ctx > 0
        assert (out[~live] == 0).all()
        assert_rows_close(out[live], ref[live], ATTN_REL_TOL)


@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(32, 4), (16, 8)])   # Qwen3-30B-A3B, -0.6B
@pytest.mark.parametrize("batch", [24, 32, 40, 64, 200])
def test_decode_attention_at_serving_batches_matches_ref(num_q_heads, num_kv_heads, batch):
    """The serving batches' launch choice (from WIDE_FROM_PROGRAMS pairs: one wave of programs,
    128-token tiles, 1-2 splits; below it the older choice) at the engine's graph width, with
    contexts of 0 to 4,096 tokens, in bf16 against the reference; twice (the merge counters)."""
    gen = torch.Generator().manual_seed(batch * 10 + num_kv_heads)
    ctxs = torch.randint(0, 4097, (batch,), generator=gen, device="cpu").tolist()
    ctxs[0], ctxs[-1] = 0, 4096
    k_cache, v_cache, tables = paged_cache(ctxs, 16, num_kv_heads)
    tables = torch.nn.functional.pad(tables, (0, 256 - tables.shape[1]), value=0)  # (crops past 256)
    ctx = torch.tensor(ctxs, dtype=torch.int32)
    splits = decode_attention.choose_num_splits(batch, num_kv_heads, 4096, torch.device("cuda"))
    launch = decode_attention.launch_config(batch * num_kv_heads, splits, 4096)
    if batch * num_kv_heads >= decode_attention.WIDE_FROM_PROGRAMS:
        assert splits <= 2 and launch["BLOCK_N"] == 128, (splits, launch)
    for _ in range(2):
        q = torch.randn(batch, num_q_heads, HEAD_DIM, dtype=BF16)
        out = paged_decode_attention(q, k_cache, v_cache, tables, ctx, HEAD_DIM**-0.5,
                                     out=torch.full_like(q, NAN))
        ref = paged_decode_attention_ref(q, k_cache, v_cache, tables, ctx, HEAD_DIM**-0.5)
        live = ctx > 0
        assert (out[~live] == 0).all()
        assert_rows_close(out[live], ref[live], ATTN_REL_TOL)


@pytest.mark.parametrize("context_len", [1, 17, 400, 2049, 4096])
def test_batch1_decode_attention_matches_ref(context_len):
    k_cache, v_cache, tables = paged_cache([context_len], 16, 8)
    tables = torch.nn.functional.pad(tables, (0, 256 - tables.shape[1]), value=-1)  # max_model_len 4096
    ctx = torch.tensor([context_len], dtype=torch.int32)
    q = torch.randn(1, 16, HEAD_DIM, dtype=BF16)
    out = paged_decode_attention(q, k_cache, v_cache, tables, ctx, HEAD_DIM**-0.5)
    assert_rows_close(out, paged_decode_attention_ref(q, k_cache, v_cache, tables, ctx, HEAD_DIM**-0.5), ATTN_REL_TOL)


PREFILL_SEQS = [  # (q_len, context_len): prefill, chunks after prefixes / prefix-cache hits
    (1024, 1024), (1, 1), (17, 17), (100, 600), (33, 4096), (500, 513), (16, 4000),
]


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("num_q_heads,num_kv_heads", HEADS)
@pytest.mark.parametrize("seqs", [PREFILL_SEQS, [(16, 4000)], [(64, 3000), (3, 50)]], ids=["mixed", "chunk", "pair"])
def test_prefill_attention_matches_ref(block_size, num_q_heads, num_kv_heads, seqs):
    qlens, ctxs = [s[0] for s in seqs], [s[1] for s in seqs]
    k_cache, v_cache, tables = paged_cache(ctxs, block_size, num_kv_heads)
    q = torch.randn(sum(qlens), num_q_heads, HEAD_DIM, dtype=BF16)
    cu = torch.tensor([0] + torch.tensor(qlens).cumsum(0).tolist(), dtype=torch.int32)
    ctx = torch.tensor(ctxs, dtype=torch.int32)
    args = (q, k_cache, v_cache, cu, ctx, tables, HEAD_DIM**-0.5, max(qlens))
    assert_rows_close(paged_prefill_attention(*args), paged_prefill_attention_ref(*args), ATTN_REL_TOL)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("num_q_heads,num_kv_heads", HEADS)
def test_attention_probs_match_ref(block_size, num_q_heads, num_kv_heads):
    ctxs = [1, 17, 1000, 4095]
    k_cache, _, tables = paged_cache(ctxs, block_size, num_kv_heads)
    q = torch.randn(num_q_heads, HEAD_DIM, dtype=BF16)
    for b, c in enumerate(ctxs):
        length = torch.tensor([c], dtype=torch.int32)
        out = attention_probs(q, k_cache, tables[b], length, HEAD_DIM**-0.5, torch.full((num_q_heads, 4096), NAN))
        ref = attention_probs_ref(q, k_cache, tables[b], length, HEAD_DIM**-0.5, torch.empty(num_q_heads, 4096))
        assert (out[:, c:] == 0).all()
        torch.testing.assert_close(out.sum(-1), torch.ones(num_q_heads), atol=1e-4, rtol=0)
        assert_rows_close(out, ref, ATTN_REL_TOL)


def test_decode_attention_replays_from_a_cuda_graph_with_new_lengths_and_tables():
    batch, num_q_heads, num_kv_heads, block_size, max_blocks = 8, 16, 8, 16, 256
    k_cache = torch.randn(2048, block_size, num_kv_heads, HEAD_DIM, dtype=BF16)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(batch, num_q_heads, HEAD_DIM, dtype=BF16)
    tables = torch.randint(0, 2048, (batch, max_blocks), dtype=torch.int32)
    ctx = torch.full((batch,), 100, dtype=torch.int32)
    out = torch.empty_like(q)
    scale = HEAD_DIM**-0.5

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and allocate the split workspace before capture
        paged_decode_attention(q, k_cache, v_cache, tables, ctx, scale, out=out)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_decode_attention(q, k_cache, v_cache, tables, ctx, scale, out=out)

    for lengths in ([1, 4096, 17, 0, 333, 2048, 15, 1000], [4000, 3, 0, 0, 64, 65, 4095, 128],
                    [400] * batch):
        ctx.copy_(torch.tensor(lengths, dtype=torch.int32))
        tables.copy_(torch.stack([torch.randperm(2048, dtype=torch.int32)[:max_blocks] for _ in range(batch)]))
        q.copy_(torch.randn_like(q))
        out.fill_(NAN)
        graph.replay()
        torch.cuda.synchronize()
        ref = paged_decode_attention_ref(q, k_cache, v_cache, tables, ctx, scale)
        live = ctx > 0
        assert (out[~live] == 0).all()
        assert_rows_close(out[live], ref[live], ATTN_REL_TOL)


@pytest.mark.parametrize("num_q_heads, num_kv_heads", HEADS)
@pytest.mark.parametrize("batch, prefix_blocks, own", [(8, 128, 40), (64, 128, 64), (256, 128, 64),
                                                       (16, 1024, 300)])
def test_cascade_decode_attention_matches_plain_kernel(num_q_heads, num_kv_heads, batch,
                                                       prefix_blocks, own):
    """Rows sharing a prefix of physical blocks (prefix caching) read it once: the same
    attention as the plain kernel in bf16, at serving batches and a 16k-token prefix."""
    from engine.kernels.cascade_attention import CascadeInputs, cascade_decode_attention
    from test_cascade_attention import shared_batch
    bs = 16
    g = torch.Generator().manual_seed(batch)
    ctxs = [prefix_blocks * bs + int(torch.randint(1, own, (1,), generator=g, device="cpu"))
            for _ in range(batch)]
    grouped = set(range(batch)) - {batch // 2}            # one row outside the group
    with torch.device("cpu"):
        k, v, tables = shared_batch(ctxs, grouped, prefix_blocks, bs, num_kv_heads, HEAD_DIM,
                                    BF16, seed=batch)
    k, v, tables = k.cuda(), v.cuda(), tables.cuda()
    ctx = torch.tensor(ctxs, dtype=torch.int32)
    q = torch.randn(batch, num_q_heads, HEAD_DIM, dtype=BF16)
    first = torch.tensor([prefix_blocks * bs if i in grouped else 0 for i in range(batch)],
                         dtype=torch.int32)
    lead = torch.tensor([min(grouped)], dtype=torch.int32)
    out = cascade_decode_attention(q, k, v, tables, ctx, HEAD_DIM ** -0.5,
                                   CascadeInputs(first, lead, tables.shape[1] * bs))
    ref = paged_decode_attention(q, k, v, tables, ctx, HEAD_DIM ** -0.5)
    assert_rows_close(out.float(), ref.float(), ATTN_REL_TOL)
