"""The eager kernels compile once per launch configuration, not once per step's counts and
slice offsets (engine/kernels/jit_keys.py): the batch sizes, pair counts, split counts,
block-table widths and the staging buffer's offsets a serving run meets compile nothing new
after the first call. With Triton's default keys each of these loops compiled again (the
first-run dip: 1.8 s at Qwen3-0.6B, 4.8 s at Qwen3-30B-A3B on an H200)."""

import os

import pytest
import torch

pytestmark = pytest.mark.gpu

if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("TRITON_INTERPRET=1 in this process: nothing compiles", allow_module_level=True)
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


def _compiled(kernel) -> int:
    """How many binaries this JITFunction holds for the current device (all its keys)."""
    caches = kernel.device_caches[torch.cuda.current_device()]
    return len(caches[0])


def test_sampling_compiles_once_across_batches_and_staging_offsets():
    from engine.kernels import sampling_kernel as sk
    g = torch.Generator(device="cuda").manual_seed(3)
    V = 1000
    temp = torch.rand(300, device="cuda", generator=g) + 0.5
    seeds = torch.randint(0, 2**40, (300,), device="cuda", generator=g)
    pos = torch.randint(0, 4000, (300,), device="cuda", generator=g)
    logits = torch.randn(64, V, device="cuda", generator=g)
    sk.gumbel_argmax(logits[:9], temp[:9], seeds[:9], pos[:9], block=256)
    before = (_compiled(sk._partial_kernel), _compiled(sk._reduce_kernel))
    for b in (9, 13, 16, 17, 33, 64):
        for off in (0, 1, 3, 5):     # slices at odd element offsets: 4- or 8-byte aligned
            got = sk.gumbel_argmax(logits[:b], temp[off:off + b], seeds[off:off + b],
                                   pos[off:off + b], block=256)
            want = sk.gumbel_argmax_ref(logits[:b], temp[off:off + b], seeds[off:off + b],
                                        pos[off:off + b])
            assert torch.equal(got, want)
    assert (_compiled(sk._partial_kernel), _compiled(sk._reduce_kernel)) == before


def test_prefill_attention_compiles_once_per_split_mode():
    from engine.kernels import prefill_attention as pa
    g = torch.Generator(device="cuda").manual_seed(5)
    D, hq, hkv, page = 128, 16, 8, 16
    k_cache = torch.randn(512, page, hkv, D, device="cuda", generator=g).to(torch.bfloat16)
    v_cache = torch.randn_like(k_cache)

    def call(qlens, ctxs, width, num_splits, off):
        q = torch.randn(sum(qlens), hq, D, device="cuda", generator=g).to(torch.bfloat16)
        meta = torch.zeros(off + 2 * len(qlens) + 1, dtype=torch.int32, device="cuda")
        cu = meta[off:off + len(qlens) + 1]          # staged at an offset, as the engine's are
        cu.copy_(torch.tensor([0] + torch.tensor(qlens).cumsum(0).tolist(), dtype=torch.int32))
        ctx = meta[off + len(qlens) + 1:]
        ctx.copy_(torch.tensor(ctxs, dtype=torch.int32))
        tables = torch.randperm(512, device="cuda", generator=g)[:len(qlens) * width]
        tables = tables.to(torch.int32).view(len(qlens), width)
        args = (q, k_cache, v_cache, cu, ctx, tables, D ** -0.5, max(qlens))
        got = pa.paged_prefill_attention(*args, num_splits=num_splits)
        want = pa.paged_prefill_attention_ref(*args)
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)

    call([40, 7], [100, 60], 9, 2, 0)                # compile the split mode
    call([33], [50], 4, 1, 0)                        # and the one-split mode
    before = _compiled(pa._prefill_kernel)
    for qlens, ctxs, width, splits, off in (([16, 1, 5], [200, 17, 5], 16, 3, 1),
                                           ([64], [64], 5, 16, 2), ([3, 3], [300, 30], 19, 5, 3),
                                           ([20], [150], 10, 1, 1), ([1, 2, 3, 4], [9, 8, 7, 6], 1, 1, 7)):
        call(qlens, ctxs, width, splits, off)
    assert _compiled(pa._prefill_kernel) == before


def test_moe_align_and_grouped_gemms_compile_once_across_token_counts():
    from engine.kernels import fused_moe as fm
    from engine.kernels import moe_align as ma
    g = torch.Generator(device="cuda").manual_seed(9)
    E, K, H, I = 64, 4, 256, 128
    w13 = (torch.randn(E, 2 * I, H, device="cuda", generator=g) / H ** 0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, H, I, device="cuda", generator=g) / I ** 0.5).to(torch.bfloat16)
    config = fm.pick_config(512, K, E)

    def call(n, off):
        x = torch.randn(n, H, device="cuda", generator=g).to(torch.bfloat16)
        # distinct experts per token, staged `off` elements into a buffer (alignment varies)
        ids_buf = torch.zeros(off + n * K, dtype=torch.int32, device="cuda")
        ids = ids_buf[off:].view(n, K)
        ids.copy_(torch.rand(n, E, device="cuda", generator=g).argsort(-1)[:, :K])
        w_buf = torch.zeros(off + n * K, device="cuda")
        w = w_buf[off:].view(n, K)
        w.copy_(torch.rand(n, K, device="cuda", generator=g))
        got = fm.fused_moe(x, w13, w2, w, ids, config=config)
        want = fm.fused_moe_ref(x, w13, w2, w, ids)
        torch.testing.assert_close(got.float(), want.float(), rtol=3e-2, atol=3e-2)

    call(300, 0)
    kernels = [k for k in (getattr(ma, n, None) for n in dir(ma)) if hasattr(k, "device_caches")]
    kernels += [fm._w13_silu_mul_kernel, fm._w2_weighted_kernel]
    before = [_compiled(k) if torch.cuda.current_device() in k.device_caches else 0 for k in kernels]
    for n, off in ((301, 1), (320, 3), (333, 0), (400, 5), (257, 2), (511, 7)):
        call(n, off)
    after = [_compiled(k) if torch.cuda.current_device() in k.device_caches else 0 for k in kernels]
    assert after == before, [(k.fn.__name__, b, a) for k, b, a in zip(kernels, before, after) if a != b]
