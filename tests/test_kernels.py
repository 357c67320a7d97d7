"""Each Triton kernel against its torch reference at small shapes (Triton's interpreter on a CPU,
compiled where CUDA is present), and each reference against an independent dense computation,
so a wrong reference fails too."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton.language.standard as triton_stdlib
import triton.runtime.jit as triton_jit
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, Qwen3RotaryEmbedding, apply_rotary_pos_emb

pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered in log2")  # lse of an empty split

# On a CPU-only machine the kernels run in Triton's interpreter, which tests/conftest.py turns on
# for the whole process before anything imports triton; with CUDA present they run compiled.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


from engine.kernels import activation, rmsnorm as norm, rotary, store_kvcache as kvstore
from engine.kernels import qk_norm_rope_store as fused
from engine.kernels import attention_probe as probe, decode_attention as decode, prefill_attention as prefill

# If triton was imported with the interpreter off on a CPU-only machine (TRITON_INTERPRET=0 given
# by hand), triton's own library (tl.sum, ...) and our kernels are compiled-only and cannot be
# rebuilt in this process: run this file again in a fresh one with the interpreter instead.
TRITON_IMPORTED_COMPILED = DEVICE == "cpu" and any(
    isinstance(fn, triton_jit.JITFunction) for fn in (triton_stdlib.sum, decode._decode_split_kernel))


def test_kernels_pass_in_a_fresh_interpreter_process():
    if not TRITON_IMPORTED_COMPILED:
        pytest.skip("triton is interpreted in this process; the tests below run here")
    root = Path(__file__).resolve().parents[1]
    run = subprocess.run(
        [sys.executable, "-m", "pytest", str(Path(__file__).resolve()), "-q", "-p", "no:cacheprovider"],
        cwd=root, env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True,
    )
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]


NAN = float("nan")
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=4e-3, rtol=4e-3)}


@pytest.fixture(autouse=True)
def _seed(request):
    if TRITON_IMPORTED_COMPILED and request.node.originalname != "test_kernels_pass_in_a_fresh_interpreter_process":
        pytest.skip("triton was imported compiled in this process; covered by the fresh-process test")
    torch.manual_seed(0)
    with torch.device(DEVICE):
        yield


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ---------------------------------------------------------------- paged-cache helpers (independent of the kernels)

def paged_kv(ctxs, block_size, num_kv_heads, head_dim, dtype, spare_blocks=3):
    """Random contiguous K/V per sequence, written slot by slot into a NaN-poisoned paged cache
    through shuffled block ids; unused table entries hold -1 or out-of-range garbage."""
    num_blocks = sum(_cdiv(c, block_size) for c in ctxs) + spare_blocks
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, NAN, dtype=dtype)
    v_cache = torch.full(shape, NAN, dtype=dtype)
    ids = torch.randperm(num_blocks)
    max_blocks = max(_cdiv(c, block_size) for c in ctxs) + 2
    block_tables = torch.full((len(ctxs), max_blocks), -1, dtype=torch.int32)
    keys, values, used = [], [], 0
    for b, ctx in enumerate(ctxs):
        n = _cdiv(ctx, block_size)
        block_tables[b, :n] = ids[used:used + n].int()
        block_tables[b, n:] = -1 if b % 2 else 10**6 + b
        used += n
        k = torch.randn(ctx, num_kv_heads, head_dim).to(dtype)
        v = torch.randn(ctx, num_kv_heads, head_dim).to(dtype)
        for t in range(ctx):
            k_cache[block_tables[b, t // block_size], t % block_size] = k[t]
            v_cache[block_tables[b, t // block_size], t % block_size] = v[t]
        keys.append(k)
        values.append(v)
    return k_cache, v_cache, block_tables, keys, values


def dense_attention(q, k, v, scale, q_positions):
    """q [n, Hq, D] against contiguous k/v [ctx, Hkv, D] in float64, causal mask built by hand."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    future = torch.arange(k.shape[0])[None, :] > q_positions[:, None]  # [n, ctx]
    scores = scores.masked_fill(future[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


# ---------------------------------------------------------------- store_kvcache

@pytest.mark.parametrize("block_size", [1, 5, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_store_kvcache_writes_each_token_to_its_slot_and_skips_padding(block_size, dtype, slot_dtype):
    num_blocks, hkv, d, n = 12, 2, 32, 9
    # key/value as strided views of one fused qkv projection, as the model produces them
    qkv = torch.randn(n, (4 + 2 * hkv) * d).to(dtype)
    key = qkv[:, 4 * d:(4 + hkv) * d].view(n, hkv, d)
    value = qkv[:, (4 + hkv) * d:].view(n, hkv, d)
    slots = torch.randperm(num_blocks * block_size)[:n].to(slot_dtype)
    slots[[1, 5]] = -1
    caches = {}
    for name, fn in (("kernel", kvstore.store_kvcache), ("ref", kvstore.store_kvcache_ref)):
        kv = torch.full((2, num_blocks, block_size, hkv, d), NAN, dtype=dtype)
        fn(key, value, kv[0], kv[1], slots)
        caches[name] = kv
    assert torch.equal(caches["kernel"].nan_to_num(7.0), caches["ref"].nan_to_num(7.0))
    flat = caches["ref"].view(2, -1, hkv, d)
    keep = slots >= 0
    assert torch.equal(flat[0, slots[keep].long()], key[keep])
    assert torch.equal(flat[1, slots[keep].long()], value[keep])
    assert flat.isnan().all(-1).all(-1).sum().item() == 2 * (num_blocks * block_size - keep.sum().item())


# ---------------------------------------------------------------- rmsnorm

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_rms_norm_ref_equals_hf_qwen3_rmsnorm(dtype):
    hf = Qwen3RMSNorm(96, eps=1e-6).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(96))
    x = torch.randn(11, 96).to(dtype)
    with torch.no_grad():
        assert torch.equal(norm.rms_norm_ref(x, hf.weight, 1e-6), hf(x))
        residual = torch.randn(11, 96).to(dtype)
        out, res_out = norm.fused_add_rms_norm_ref(x, residual, hf.weight, 1e-6)
        assert torch.equal(res_out, x + residual)
        assert torch.equal(out, hf(x + residual))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("hidden", [96, 256])
def test_rms_norm_kernel_matches_ref(dtype, hidden):
    x = torch.randn(37, hidden).to(dtype)
    w = torch.randn(hidden).to(dtype)
    torch.testing.assert_close(norm.rms_norm(x, w, 1e-6), norm.rms_norm_ref(x, w, 1e-6), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rms_norm_kernel_normalises_head_rows_of_a_strided_q_view(dtype):
    n, heads, d = 5, 4, 32
    qkv = torch.randn(n, (heads + 4) * d).to(dtype)
    q = qkv[:, :heads * d].view(n, heads, d)  # non-contiguous rows: the q/k-norm case
    w = torch.randn(d).to(dtype)
    out = norm.rms_norm(q, w, 1e-6)
    assert out.shape == q.shape
    torch.testing.assert_close(out, norm.rms_norm_ref(q, w, 1e-6), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_add_rms_norm_kernel_matches_ref(dtype):
    x, residual = torch.randn(2, 13, 96).to(dtype)
    w = torch.randn(96).to(dtype)
    out, res_out = norm.fused_add_rms_norm(x, residual, w, 1e-5)
    ref_out, ref_res = norm.fused_add_rms_norm_ref(x, residual, w, 1e-5)
    torch.testing.assert_close(res_out, ref_res, atol=0, rtol=0)
    torch.testing.assert_close(out, ref_out, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("fused", [False, True])
def test_rms_norm_kernel_writes_residual_sumsq_for_probes(dtype, fused):
    """The probes' residual norms come from the norm kernel's own sum of squares: it must be
    ||x + residual||^2 of the stored (rounded) residual, row by row, and leave rows past N alone."""
    x, residual = torch.randn(2, 21, 256).to(dtype) * 3
    w = torch.randn(256).to(dtype)
    sumsq = torch.full((25,), -7.0)
    ref_sumsq = torch.full((25,), -7.0)
    if fused:
        out, res = norm.fused_add_rms_norm(x, residual, w, 1e-6, sumsq)
        ref_out, ref_res = norm.fused_add_rms_norm_ref(x, residual, w, 1e-6, ref_sumsq)
        stream = ref_res
    else:
        out = norm.rms_norm(x, w, 1e-6, sumsq)
        ref_out = norm.rms_norm_ref(x, w, 1e-6, ref_sumsq)
        stream = x
    torch.testing.assert_close(out, ref_out, **TOL[dtype])
    expect = stream.float().pow(2).sum(-1)
    torch.testing.assert_close(sumsq[:21], expect, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(ref_sumsq[:21], expect, rtol=1e-5, atol=1e-4)
    assert (sumsq[21:] == -7.0).all() and (ref_sumsq[21:] == -7.0).all()


# ---------------------------------------------------------------- rotary

@pytest.mark.parametrize("head_dim,base", [(32, 10000.0), (128, 1e6)])
def test_cos_sin_cache_equals_hf_rotary_embedding(head_dim, base):
    config = Qwen3Config(head_dim=head_dim, rope_parameters={"rope_type": "default", "rope_theta": base},
                         max_position_embeddings=300)
    with torch.device("cpu"):  # as a model built on the CPU and moved
        hf_rope = Qwen3RotaryEmbedding(config)
    cos, sin = hf_rope.to(DEVICE)(torch.zeros(1), torch.arange(300)[None])
    cache = rotary.build_cos_sin_cache(head_dim, 300, base, DEVICE)
    assert cache.dtype == torch.float32 and cache.shape == (300, head_dim)
    half = head_dim // 2
    assert torch.equal(cache[:, :half], cos[0, :, :half])
    assert torch.equal(cache[:, half:], sin[0, :, :half])


def test_rotary_ref_equals_hf_apply_rotary_pos_emb():
    n, hq, hkv, d = 9, 4, 2, 32
    cache = rotary.build_cos_sin_cache(d, 64, 10000.0, DEVICE)
    positions = torch.randint(0, 64, (n,))
    q, k = torch.randn(n, hq, d), torch.randn(n, hkv, d)
    cos = torch.cat([cache[positions, :d // 2]] * 2, -1)[None]  # [1, n, D], HF's layout
    sin = torch.cat([cache[positions, d // 2:]] * 2, -1)[None]
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    out_q, out_k = rotary.apply_rotary_ref(q.clone(), k.clone(), positions, cache)
    torch.testing.assert_close(out_q, hf_q[0].transpose(0, 1), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out_k, hf_k[0].transpose(0, 1), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("head_dim", [32, 64])
def test_rotary_kernel_rotates_strided_q_and_k_in_place_like_ref(dtype, head_dim):
    n, hq, hkv = 7, 4, 2
    cache = rotary.build_cos_sin_cache(head_dim, 128, 1e6, DEVICE)
    positions = torch.randint(0, 128, (n,))
    qkv = torch.randn(n, (hq + 2 * hkv) * head_dim).to(dtype)
    expected = qkv.clone()
    q = qkv[:, :hq * head_dim].view(n, hq, head_dim)
    k = qkv[:, hq * head_dim:(hq + hkv) * head_dim].view(n, hkv, head_dim)
    ref_q, ref_k = rotary.apply_rotary_ref(q.clone(), k.clone(), positions, cache)
    out_q, out_k = rotary.apply_rotary(q, k, positions, cache)
    assert out_q.data_ptr() == q.data_ptr() and out_k.data_ptr() == k.data_ptr()
    torch.testing.assert_close(out_q, ref_q, **TOL[dtype])
    torch.testing.assert_close(out_k, ref_k, **TOL[dtype])
    assert torch.equal(qkv[:, (hq + hkv) * head_dim:], expected[:, (hq + hkv) * head_dim:])  # v untouched


# ---------------------------------------------------------------- fused q/k norm + RoPE + K/V store

MAX_POSITIONS = 40976  # Qwen3's rotary table length: large positions index far into it


def _fused_inputs(n, hq, hkv, d, dtype, qk_norm, block_size=4, num_blocks=8):
    """qkv as a column slice of a wider buffer (row stride > width, as a strided projection
    output), fresh random positions up to the table's end, shuffled slots with padding (-1)."""
    width = (hq + 2 * hkv) * d
    qkv = (torch.randn(n, width + 24) * 2).to(dtype)[:, 24:]
    positions = torch.randint(0, MAX_POSITIONS, (n,))
    positions[0] = MAX_POSITIONS - 1
    slots = torch.randperm(num_blocks * block_size)[:n]
    slots[1::4] = -1
    weights = (torch.randn(d).to(dtype), torch.randn(d).to(dtype)) if qk_norm else (None, None)
    cache = rotary.build_cos_sin_cache(d, MAX_POSITIONS, 1e6, DEVICE)
    return qkv, positions, slots, weights, cache, (num_blocks, block_size, hkv, d)


def _unfused_triton(qkv, positions, cache, k_cache, v_cache, slots, hq, hkv, q_w, k_w, eps):
    """Today's CUDA sequence in QwenAttention: split, q_norm, k_norm, rotary, store (4 launches)."""
    n, d = qkv.shape[0], cache.shape[-1]
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], -1)
    q, k, v = q.reshape(n, hq, d), k.reshape(n, hkv, d), v.reshape(n, hkv, d)
    if q_w is not None:
        q = norm.rms_norm(q.reshape(-1, d), q_w, eps).view(n, hq, d)
        k = norm.rms_norm(k.reshape(-1, d), k_w, eps).view(n, hkv, d)
    else:
        q, k = q.clone(), k.clone()  # the model rotates views of qkv in place; keep the input
    q, k = rotary.apply_rotary(q, k, positions, cache)
    kvstore.store_kvcache(k, v, k_cache, v_cache, slots)
    return q


FUSED_HEADS = [(4, 2), (4, 4), (3, 1)]  # GQA, MHA, a single KV head (and Hq not a power of 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("hq,hkv", FUSED_HEADS)
@pytest.mark.parametrize("head_dim", [16, 64, 128])
@pytest.mark.parametrize("qk_norm", [True, False])
def test_qk_norm_rope_store_equals_the_unfused_kernels_bit_for_bit(dtype, hq, hkv, head_dim, qk_norm):
    """Same rounding points, same reductions: q and both caches equal the four-launch sequence
    exactly; padding slots leave the cache untouched (NaN)."""
    qkv, positions, slots, (q_w, k_w), cache, cache_shape = _fused_inputs(9, hq, hkv, head_dim, dtype, qk_norm)
    before = qkv.clone()
    got_kv = torch.full((2, *cache_shape), NAN, dtype=dtype)
    want_kv = got_kv.clone()
    q = fused.qk_norm_rope_store(qkv, positions, cache, got_kv[0], got_kv[1], slots, hq, hkv, q_w, k_w, 1e-6)
    want_q = _unfused_triton(qkv, positions, cache, want_kv[0], want_kv[1], slots, hq, hkv, q_w, k_w, 1e-6)
    assert q.shape == (9, hq, head_dim) and q.dtype == dtype and q.is_contiguous()
    assert torch.equal(q, want_q)
    assert torch.equal(got_kv.nan_to_num(7.0), want_kv.nan_to_num(7.0))
    assert torch.equal(qkv, before)  # the projection output is read, never written
    stored = (slots >= 0).sum().item()
    assert got_kv.isnan().all(-1).all(-1).sum().item() == 2 * (cache_shape[0] * cache_shape[1] - stored)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("hq,hkv", FUSED_HEADS)
@pytest.mark.parametrize("qk_norm", [True, False])
def test_qk_norm_rope_store_kernel_matches_ref(dtype, hq, hkv, qk_norm):
    qkv, positions, slots, (q_w, k_w), cache, cache_shape = _fused_inputs(11, hq, hkv, 64, dtype, qk_norm)
    got_kv = torch.full((2, *cache_shape), NAN, dtype=dtype)
    want_kv = got_kv.clone()
    q = fused.qk_norm_rope_store(qkv, positions, cache, got_kv[0], got_kv[1], slots, hq, hkv, q_w, k_w, 1e-6)
    want_q = fused.qk_norm_rope_store_ref(qkv, positions, cache, want_kv[0], want_kv[1], slots, hq, hkv,
                                          q_w, k_w, 1e-6)
    if qk_norm:  # the norm's fp32 sum of squares adds in another order than torch's mean
        torch.testing.assert_close(q, want_q, **TOL[dtype])
        torch.testing.assert_close(got_kv.nan_to_num(7.0), want_kv.nan_to_num(7.0), **TOL[dtype])
    else:        # RoPE alone is elementwise: bit for bit
        assert torch.equal(q, want_q)
        assert torch.equal(got_kv.nan_to_num(7.0), want_kv.nan_to_num(7.0))


@pytest.mark.parametrize("qk_norm", [True, False])
def test_qk_norm_rope_store_ref_equals_hf_norm_and_rotary_with_a_dense_store(qk_norm):
    """The reference against HF's own modules and a slot-by-slot store, so a wrong ref fails."""
    n, hq, hkv, d, eps = 7, 4, 2, 32, 1e-6
    qkv, positions, slots, (q_w, k_w), cache, cache_shape = _fused_inputs(n, hq, hkv, d, torch.float32, qk_norm)
    kv = torch.full((2, *cache_shape), NAN)
    q = fused.qk_norm_rope_store_ref(qkv, positions, cache, kv[0], kv[1], slots, hq, hkv, q_w, k_w, eps)
    hf_q = qkv[:, :hq * d].reshape(n, hq, d)
    hf_k = qkv[:, hq * d:(hq + hkv) * d].reshape(n, hkv, d)
    if qk_norm:
        q_norm, k_norm = Qwen3RMSNorm(d, eps), Qwen3RMSNorm(d, eps)
        with torch.no_grad():
            q_norm.weight.copy_(q_w)
            k_norm.weight.copy_(k_w)
            hf_q, hf_k = q_norm(hf_q), k_norm(hf_k)
    cos = torch.cat([cache[positions, :d // 2]] * 2, -1)[None]  # [1, n, D], HF's layout
    sin = torch.cat([cache[positions, d // 2:]] * 2, -1)[None]
    hf_q, hf_k = apply_rotary_pos_emb(hf_q.transpose(0, 1)[None], hf_k.transpose(0, 1)[None], cos, sin)
    hf_q, hf_k = hf_q[0].transpose(0, 1), hf_k[0].transpose(0, 1)
    torch.testing.assert_close(q, hf_q, atol=1e-6, rtol=1e-6)
    v = qkv[:, (hq + hkv) * d:].reshape(n, hkv, d)
    for t in range(n):
        s = slots[t].item()
        if s >= 0:
            torch.testing.assert_close(kv[0, s // 4, s % 4], hf_k[t], atol=1e-6, rtol=1e-6)
            assert torch.equal(kv[1, s // 4, s % 4], v[t])


@pytest.mark.parametrize("qk_norm", [True, False])
def test_qk_norm_rope_store_copies_the_probe_rows_from_a_device_index(qk_norm):
    """Rows read from a device tensor (a CUDA graph replays with new ones): each listed row's q
    lands in its probe slot, -1 copies nothing, and q itself is unchanged by the probe."""
    hq, hkv, d, n = 4, 2, 32, 10
    qkv, positions, slots, (q_w, k_w), cache, cache_shape = _fused_inputs(n, hq, hkv, d, torch.float32, qk_norm)
    kv = torch.full((2, *cache_shape), NAN)
    plain = fused.qk_norm_rope_store(qkv, positions, cache, kv[0].clone(), kv[1].clone(), slots, hq, hkv,
                                     q_w, k_w, 1e-6)
    for rows in ([6], [9, 0, -1], [3, 3]):
        probe_rows = torch.tensor(rows, dtype=torch.int64)
        probe_q = torch.full((len(rows), hq, d), -5.0)
        ref_probe_q = probe_q.clone()
        q = fused.qk_norm_rope_store(qkv, positions, cache, kv[0], kv[1], slots, hq, hkv, q_w, k_w, 1e-6,
                                     probe_rows=probe_rows, probe_q=probe_q)
        fused.qk_norm_rope_store_ref(qkv, positions, cache, kv[0].clone(), kv[1].clone(), slots, hq, hkv,
                                     q_w, k_w, 1e-6, probe_rows=probe_rows, probe_q=ref_probe_q)
        assert torch.equal(q, plain)
        for i, r in enumerate(rows):
            want = plain[r] if r >= 0 else torch.full((hq, d), -5.0)
            assert torch.equal(probe_q[i], want)
        torch.testing.assert_close(ref_probe_q, probe_q, **TOL[torch.float32])
    scalar = torch.tensor(4, dtype=torch.int64)  # a 0-d index: one probe row
    probe_q = torch.zeros(1, hq, d)
    fused.qk_norm_rope_store(qkv, positions, cache, kv[0], kv[1], slots, hq, hkv, q_w, k_w, 1e-6,
                             probe_rows=scalar, probe_q=probe_q)
    assert torch.equal(probe_q[0], plain[4])


def test_qk_norm_rope_store_takes_int32_indices_an_output_buffer_and_no_tokens():
    hq, hkv, d = 4, 2, 16
    qkv, positions, slots, (q_w, k_w), cache, cache_shape = _fused_inputs(6, hq, hkv, d, torch.float16, True)
    kv64 = torch.full((2, *cache_shape), NAN, dtype=torch.float16)
    kv32 = kv64.clone()
    want = fused.qk_norm_rope_store(qkv, positions, cache, kv64[0], kv64[1], slots, hq, hkv, q_w, k_w, 1e-6)
    q_out = torch.empty(6, hq, d, dtype=torch.float16)
    got = fused.qk_norm_rope_store(qkv, positions.int(), cache, kv32[0], kv32[1], slots.int(), hq, hkv,
                                   q_w, k_w, 1e-6, q_out=q_out)
    assert got.data_ptr() == q_out.data_ptr() and torch.equal(got, want)
    assert torch.equal(kv32.nan_to_num(7.0), kv64.nan_to_num(7.0))
    empty = fused.qk_norm_rope_store(qkv[:0], positions[:0], cache, kv32[0], kv32[1], slots[:0], hq, hkv,
                                     q_w, k_w, 1e-6)
    assert empty.shape == (0, hq, d) and torch.equal(kv32.nan_to_num(7.0), kv64.nan_to_num(7.0))


def test_qk_norm_rope_store_rejects_inputs_it_would_misread():
    hq, hkv, d = 4, 2, 16
    qkv, positions, slots, (q_w, k_w), cache, cache_shape = _fused_inputs(5, hq, hkv, d, torch.float32, True)
    kv = torch.zeros(2, *cache_shape)
    args = (positions, cache, kv[0], kv[1], slots, hq, hkv)
    with pytest.raises(ValueError, match="qkv must be"):
        fused.qk_norm_rope_store(qkv[:, :-d], *args)
    with pytest.raises(ValueError, match="contiguous last dim"):
        fused.qk_norm_rope_store(torch.randn(qkv.shape[1], 5).t(), *args)
    with pytest.raises(ValueError, match="cos_sin_cache must be fp32"):
        fused.qk_norm_rope_store(qkv, positions, cache.half(), kv[0], kv[1], slots, hq, hkv)
    with pytest.raises(ValueError, match="come together"):
        fused.qk_norm_rope_store(qkv, *args, q_w, None)
    with pytest.raises(ValueError, match="probe_q must be"):
        fused.qk_norm_rope_store(qkv, *args, probe_rows=torch.tensor([1, 2]), probe_q=torch.zeros(1, hq, d))


# ---------------------------------------------------------------- activation

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("inter", [40, 1500])
def test_silu_and_mul_kernel_matches_ref_and_definition(dtype, inter):
    x = torch.randn(6, 2 * inter).to(dtype)
    ref = activation.silu_and_mul_ref(x)
    gate, up = x[:, :inter].double(), x[:, inter:].double()
    torch.testing.assert_close(ref.double(), gate * torch.sigmoid(gate) * up, **TOL[dtype])
    torch.testing.assert_close(activation.silu_and_mul(x), ref, **TOL[dtype])


# ---------------------------------------------------------------- decode attention

DECODE_CASES = [  # block_size, Hq, Hkv, head_dim
    (1, 4, 2, 32),
    (5, 4, 2, 32),
    (16, 4, 2, 64),
    (16, 2, 2, 32),
    (5, 2, 2, 64),
]
DECODE_CTXS = [0, 1, 17, 40, 33, 0]  # padding rows (0), lengths off the block grid


def _decode_inputs(block_size, hq, hkv, d, dtype):
    k_cache, v_cache, tables, keys, values = paged_kv(DECODE_CTXS, block_size, hkv, d, dtype)
    q = torch.randn(len(DECODE_CTXS), hq, d).to(dtype)
    return q, k_cache, v_cache, tables, torch.tensor(DECODE_CTXS, dtype=torch.int32), keys, values


@pytest.mark.parametrize("block_size,hq,hkv,d", DECODE_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_kernel_matches_ref(block_size, hq, hkv, d, dtype, num_splits):
    q, k_cache, v_cache, tables, ctx, _, _ = _decode_inputs(block_size, hq, hkv, d, dtype)
    out = torch.full_like(q, NAN)
    got = decode.paged_decode_attention(q, k_cache, v_cache, tables, ctx, 0.17, out=out, num_splits=num_splits)
    assert got is out
    ref = decode.paged_decode_attention_ref(q, k_cache, v_cache, tables, ctx, 0.17, out=torch.full_like(q, NAN))
    assert torch.isfinite(out).all()
    assert (out[ctx == 0] == 0).all()
    torch.testing.assert_close(out, ref, **TOL[dtype])


@pytest.mark.parametrize("block_size,hq,hkv,d", DECODE_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_ref_matches_dense_attention(block_size, hq, hkv, d, dtype):
    q, k_cache, v_cache, tables, ctx, keys, values = _decode_inputs(block_size, hq, hkv, d, dtype)
    ref = decode.paged_decode_attention_ref(q, k_cache, v_cache, tables, ctx, 0.17)
    for b, c in enumerate(DECODE_CTXS):
        if c == 0:
            assert (ref[b] == 0).all()
            continue
        want = dense_attention(q[b:b + 1], keys[b], values[b], 0.17, torch.tensor([c - 1]))[0]
        torch.testing.assert_close(ref[b].double(), want, **TOL[dtype])


def test_decode_kernel_reusing_its_workspace_call_after_call_matches_ref():
    # the split merge's arrival counters must be back at zero for the next call / graph replay
    q, k_cache, v_cache, tables, ctx, _, _ = _decode_inputs(5, 4, 2, 32, torch.float32)
    for _ in range(3):
        q = torch.randn_like(q)
        out = decode.paged_decode_attention(q, k_cache, v_cache, tables, ctx, 0.17,
                                            out=torch.full_like(q, NAN), num_splits=4)
        ref = decode.paged_decode_attention_ref(q, k_cache, v_cache, tables, ctx, 0.17)
        torch.testing.assert_close(out, ref, **TOL[torch.float32])


def _decode_matches_ref(q, k_cache, v_cache, tables, ctx, num_splits, dtype):
    """The kernel, into an out of NaNs, equals the reference; an empty context gives zeros."""
    out = decode.paged_decode_attention(q, k_cache, v_cache, tables, ctx, 0.17,
                                        out=torch.full_like(q, NAN), num_splits=num_splits)
    ref = decode.paged_decode_attention_ref(q, k_cache, v_cache, tables, ctx, 0.17)
    assert (out[ctx == 0] == 0).all()
    torch.testing.assert_close(out, ref, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_splits", [1, 2, 3])
def test_decode_kernel_with_the_wide_serving_tiles_matches_ref(monkeypatch, dtype, num_splits):
    """From WIDE_FROM_PROGRAMS (batch x KV heads) the direct path and splits of long-enough
    context bounds walk 128-token tiles (SPLIT_WIDE_LAUNCH): made to apply at this small batch,
    against the reference (contexts of 0 to 40 tokens: every tile longer than a split's share)."""
    monkeypatch.setattr(decode, "WIDE_FROM_PROGRAMS", 2)
    monkeypatch.setattr(decode, "SPLIT_WIDE_MIN_TOKENS", 8)
    q, k_cache, v_cache, tables, ctx, _, _ = _decode_inputs(5, 4, 2, 32, dtype)
    bound = tables.shape[1] * k_cache.shape[1]
    assert decode.launch_config(5 * 2, num_splits, bound)["BLOCK_N"] == 128
    for _ in range(2):   # twice: the arrival counters are back at zero after a merge
        _decode_matches_ref(torch.randn_like(q), k_cache, v_cache, tables, ctx, num_splits, dtype)


def test_decode_launch_choice_by_programs_and_context_bound(monkeypatch):
    """One wave of programs and 128-token tiles from WIDE_FROM_PROGRAMS pairs on; below it
    WAVES waves, no split longer than LONG_SPLIT_TOKENS, 32-token split tiles in splits shorter
    than SPLIT_WIDE_MIN_TOKENS, 64-token direct tiles."""
    monkeypatch.setattr(decode, "num_sms", lambda device: 132)
    dev = torch.device("cpu")
    wide = decode.WIDE_FROM_PROGRAMS
    assert decode.choose_num_splits(wide // 8, 8, 4096, dev) == -(-132 // wide)   # one wave
    assert decode.choose_num_splits(132 // 8 + 1, 8, 4096, dev) == 1               # direct from 132 pairs
    assert decode.choose_num_splits(1, 8, 4096, dev) == min(decode.MAX_SPLITS, -(-2 * 132 // 8))
    assert decode.launch_config(wide, 1, 4096)["BLOCK_N"] == 128
    assert decode.launch_config(wide, 2, 4096) == decode.SPLIT_WIDE_LAUNCH
    assert decode.launch_config(wide, 2, 2 * decode.SPLIT_WIDE_MIN_TOKENS - 16) == decode.SPLIT_LAUNCH
    assert decode.launch_config(wide - 1, 2, 4096) == decode.SPLIT_WIDE_LAUNCH
    assert decode.launch_config(wide - 1, 32, 4096) == decode.SPLIT_LAUNCH        # 128 a split
    assert decode.launch_config(1 * 8, 32, 8192) == decode.SPLIT_WIDE_LAUNCH       # 256 a split
    long = decode.LONG_SPLIT_TOKENS
    assert decode.choose_num_splits(4, 8, 4096, dev) == -(-2 * 132 // 32)          # the waves
    assert decode.choose_num_splits(4, 8, 16 * long, dev) == 16                    # the context
    assert decode.choose_num_splits(4, 8, 1 << 20, dev) == decode.MAX_SPLITS
    assert decode.choose_num_splits(wide // 8, 8, 1 << 20, dev) == -(-132 // wide)  # not past wide
    assert decode.launch_config(wide - 1, 1, 4096) == decode.DIRECT_LAUNCH


@pytest.mark.parametrize("hq,hkv", [(16, 2), (6, 2), (7, 1), (2, 2)])  # GQA 8, 3, 7 (Qwen2.5), MHA
@pytest.mark.parametrize("num_splits,chunk_elems", [(3, 8192), (6, 8192), (6, 64), (32, 2048)])
def test_decode_merge_of_a_query_head_group_matches_ref(monkeypatch, hq, hkv, num_splits,
                                                        chunk_elems):
    """The last split to arrive merges every query head of its KV head at once, in chunks of
    splits (chunk_elems 64: one split a chunk, so several chunks); group sizes that are not
    powers of two leave rows of the merge tile masked."""
    monkeypatch.setattr(decode, "MERGE_CHUNK_ELEMS", chunk_elems)
    torch.manual_seed(hq * 100 + num_splits)
    q, k_cache, v_cache, tables, ctx, _, _ = _decode_inputs(5, hq, hkv, 32, torch.float32)
    for _ in range(2):   # twice: the arrival counters are back at zero after a merge
        _decode_matches_ref(torch.randn_like(q), k_cache, v_cache, tables, ctx, num_splits, torch.float32)


def test_decode_kernel_with_splits_chosen_from_shapes_matches_ref():
    q, k_cache, v_cache, tables, ctx, _, _ = _decode_inputs(5, 4, 2, 32, torch.float32)
    out = decode.paged_decode_attention(q, k_cache, v_cache, tables, ctx, 0.17, out=torch.full_like(q, NAN))
    ref = decode.paged_decode_attention_ref(q, k_cache, v_cache, tables, ctx, 0.17)
    torch.testing.assert_close(out, ref, **TOL[torch.float32])


def test_decode_splits_come_from_shapes_only():
    dev = torch.device("cpu")
    assert decode.choose_num_splits(1, 8, 4096, dev) == decode.choose_num_splits(1, 8, 4096, dev) > 1
    assert decode.choose_num_splits(256, 8, 4096, dev) == 1
    assert decode.choose_num_splits(1, 8, 16, dev) == 1  # a context of one tile is never split


# ---------------------------------------------------------------- prefill attention

# (q_len, context_len): plain prefill, chunk after a prefix / prefix-cache hit, a single token,
# an empty entry, and a prompt longer than one query tile
PREFILL_SEQS = [(5, 5), (3, 20), (1, 7), (0, 4), (37, 37), (9, 23)]
PREFILL_CASES = [(1, 4, 2, 32), (5, 4, 2, 32), (16, 2, 2, 64), (16, 4, 2, 64)]


def _prefill_inputs(block_size, hq, hkv, d, dtype):
    qlens = [s[0] for s in PREFILL_SEQS]
    ctxs = [s[1] for s in PREFILL_SEQS]
    k_cache, v_cache, tables, keys, values = paged_kv(ctxs, block_size, hkv, d, dtype)
    q = torch.randn(sum(qlens), hq, d).to(dtype)
    cu = torch.tensor([0] + torch.tensor(qlens).cumsum(0).tolist(), dtype=torch.int32)
    return q, k_cache, v_cache, cu, torch.tensor(ctxs, dtype=torch.int32), tables, max(qlens), keys, values


@pytest.mark.parametrize("block_size,hq,hkv,d,dtype,num_splits", [
    *[(*case, dtype, 1) for case in PREFILL_CASES for dtype in (torch.float32, torch.float16)],
    (5, 4, 2, 32, torch.float32, 3),   # KV range split, merged by the combine kernel
    (16, 4, 2, 64, torch.float16, 3),
    (1, 2, 2, 32, torch.float16, 2),
])
def test_prefill_kernel_matches_ref(block_size, hq, hkv, d, dtype, num_splits):
    q, k_cache, v_cache, cu, ctx, tables, max_q, _, _ = _prefill_inputs(block_size, hq, hkv, d, dtype)
    out = prefill.paged_prefill_attention(q, k_cache, v_cache, cu, ctx, tables, 0.2, max_q, num_splits=num_splits)
    ref = prefill.paged_prefill_attention_ref(q, k_cache, v_cache, cu, ctx, tables, 0.2, max_q)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, **TOL[dtype])


# long enough for tiles wholly below the causal diagonal (the unmasked loop) and a diagonal
# that starts mid-tile; both launches, and a split KV range
LONG_PREFILL_SEQS = [(70, 150), (9, 200), (130, 130), (1, 97)]


@pytest.mark.parametrize("launch", [prefill.SHORT_LAUNCH, prefill.LONG_LAUNCH,
                                    dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=1)])
@pytest.mark.parametrize("dtype,num_splits", [(torch.float32, 1), (torch.float16, 1),
                                              (torch.float32, 3)])
def test_prefill_kernel_past_the_diagonal_matches_ref(launch, dtype, num_splits):
    bs, hq, hkv, d = 16, 4, 2, 32
    qlens, ctxs = [s[0] for s in LONG_PREFILL_SEQS], [s[1] for s in LONG_PREFILL_SEQS]
    k_cache, v_cache, tables, _, _ = paged_kv(ctxs, bs, hkv, d, dtype)
    q = torch.randn(sum(qlens), hq, d).to(dtype)
    cu = torch.tensor([0] + torch.tensor(qlens).cumsum(0).tolist(), dtype=torch.int32)
    ctx = torch.tensor(ctxs, dtype=torch.int32)
    out = prefill.paged_prefill_attention(q, k_cache, v_cache, cu, ctx, tables, 0.2, max(qlens),
                                          num_splits=num_splits, launch=launch)
    ref = prefill.paged_prefill_attention_ref(q, k_cache, v_cache, cu, ctx, tables, 0.2,
                                              max(qlens))
    torch.testing.assert_close(out, ref, **TOL[dtype])


@pytest.mark.parametrize("block_size,hq,hkv,d", PREFILL_CASES)
def test_prefill_ref_matches_dense_causal_attention(block_size, hq, hkv, d):
    q, k_cache, v_cache, cu, ctx, tables, max_q, keys, values = _prefill_inputs(block_size, hq, hkv, d, torch.float32)
    ref = prefill.paged_prefill_attention_ref(q, k_cache, v_cache, cu, ctx, tables, 0.2, max_q)
    for b, (q_len, c) in enumerate(PREFILL_SEQS):
        lo = cu[b].item()
        want = dense_attention(q[lo:lo + q_len], keys[b], values[b], 0.2, torch.arange(c - q_len, c))
        torch.testing.assert_close(ref[lo:lo + q_len].double(), want, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- attention probe

@pytest.mark.parametrize("block_size,hq,hkv,d", [(5, 4, 2, 32), (16, 2, 2, 64), (1, 4, 2, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_attention_probs_kernel_matches_ref_and_dense_softmax(block_size, hq, hkv, d, dtype):
    ctxs = [23, 0, 70]
    k_cache, _, tables, keys, _ = paged_kv(ctxs, block_size, hkv, d, dtype)
    q = torch.randn(hq, d).to(dtype)
    max_context = 130  # not a multiple of the tile, longer than any context
    for b, c in enumerate(ctxs):
        length = torch.tensor([c], dtype=torch.int32)
        out = torch.full((hq, max_context), NAN)
        probe.attention_probs(q, k_cache, tables[b], length, 0.3, out)
        ref = probe.attention_probs_ref(q, k_cache, tables[b], length, 0.3, torch.full((hq, max_context), NAN))
        torch.testing.assert_close(out, ref, **TOL[dtype])
        assert (ref[:, c:] == 0).all()
        if c == 0:
            assert (out == 0).all()
            continue
        k = keys[b].double().repeat_interleave(hq // hkv, dim=1)  # [c, Hq, D]
        want = (torch.einsum("hd,thd->ht", q.double(), k) * 0.3).softmax(-1)
        torch.testing.assert_close(ref[:, :c].double(), want, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_attention_probs_layers_reads_each_layer_of_the_stacked_cache(dtype):
    """The batched probe: A query rows, each scored against its own layer of a [L, ...] K cache
    (layers chosen out of order, one repeated) equal per-layer dense softmaxes."""
    block_size, hq, hkv, d, c = 5, 4, 2, 32, 23
    layers, tables = [], None
    for _ in range(3):
        k_cache, _, t, keys, _ = paged_kv([c], block_size, hkv, d, dtype)
        tables = t if tables is None else tables
        layers.append((k_cache, keys[0]))
    # the same block table for every layer, as in the engine: reuse layer 0's
    k_all = torch.stack([layers[0][0]] + [
        _relayout(layers[0][0], tables[0], c, block_size, keys) for _, keys in layers[1:]])
    key_sets = [layers[0][1]] + [k for _, k in layers[1:]]
    layer_ids = torch.tensor([2, 0, 2], dtype=torch.int32)
    q = torch.randn(3, hq, d).to(dtype)
    length = torch.tensor([c], dtype=torch.int32)
    out = probe.attention_probs_layers(q, k_all, layer_ids, tables[0], length, 0.3,
                                       torch.full((3, hq, 40), NAN))
    ref = probe.attention_probs_layers_ref(q, k_all, layer_ids, tables[0], length, 0.3,
                                           torch.full((3, hq, 40), NAN))
    torch.testing.assert_close(out, ref, **TOL[dtype])
    for i, layer in enumerate(layer_ids.tolist()):
        k = key_sets[layer].double().repeat_interleave(hq // hkv, dim=1)
        want = (torch.einsum("hd,thd->ht", q[i].double(), k) * 0.3).softmax(-1)
        torch.testing.assert_close(out[i, :, :c].double(), want, **TOL[dtype])
        assert (out[i, :, c:] == 0).all()


def _relayout(k_cache_like, table, ctx, block_size, keys):
    """A K cache shaped like k_cache_like holding `keys` at the positions `table` maps."""
    k = torch.full_like(k_cache_like, NAN)
    for t in range(ctx):
        k[table[t // block_size], t % block_size] = keys[t]
    return k


def test_block_mass_sums_probabilities_per_kv_block():
    probs = torch.rand(3, 23)
    mass = probe.block_mass(probs, 5)
    assert mass.shape == (3, 5)
    want = torch.stack([probs[:, i:i + 5].sum(-1) for i in range(0, 23, 5)], dim=1)
    torch.testing.assert_close(mass, want)


# ---- the engine's CPU fast paths agree with the references ----------------------------------
@pytest.mark.parametrize("lens", [[37], [5, 16, 33], [16, 16]])
def test_cpu_decode_attention_equals_reference(lens):
    from engine.kernels.decode_attention import (paged_decode_attention_cpu,
                                                 paged_decode_attention_ref)
    torch.manual_seed(len(lens))
    bs, hkv, hq, d = 4, 2, 4, 16
    nblocks = 40
    k_cache, v_cache = torch.randn(2, nblocks, bs, hkv, d).unbind(0)
    perm = torch.randperm(nblocks)
    width = max((n + bs - 1) // bs for n in lens)
    tables = torch.zeros(len(lens), width, dtype=torch.int32)
    used = 0
    for i, n in enumerate(lens):
        nb = (n + bs - 1) // bs
        tables[i, :nb] = perm[used:used + nb].int()
        used += nb
    q = torch.randn(len(lens), hq, d)
    ctx = torch.tensor(lens, dtype=torch.int32)
    got = paged_decode_attention_cpu(q, k_cache, v_cache, tables, ctx, 0.25)
    ref = paged_decode_attention_ref(q, k_cache, v_cache, tables, ctx, 0.25)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_cpu_store_kvcache_equals_reference():
    from engine.kernels.store_kvcache import store_kvcache_cpu, store_kvcache_ref
    torch.manual_seed(3)
    base = torch.randn(2, 10, 4, 2, 8)
    caches = [base.clone(), base.clone()]
    key, value = torch.randn(2, 7, 2, 8).unbind(0)
    slots = torch.randperm(40)[:7]
    store_kvcache_cpu(key, value, caches[0][0], caches[0][1], slots)
    store_kvcache_ref(key, value, caches[1][0], caches[1][1], slots)
    torch.testing.assert_close(caches[0], caches[1], rtol=0, atol=0)


def test_pdl_is_never_used_on_the_cpu_or_when_turned_off():
    """The interpreter has no griddepcontrol: a CPU tensor never asks for PDL, whatever the
    launcher is told; on a GPU, pdl=False (KernelConfig.pdl) turns it off before any device query."""
    from engine.kernels import pdl
    assert not pdl.use_pdl(torch.randn(3))
    fake_cuda = type("T", (), {"is_cuda": True})()  # must not reach the capability query
    assert not pdl.use_pdl(fake_cuda, enabled=False)
