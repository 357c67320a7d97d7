"""Kernel microbenchmark: each Triton kernel vs its torch reference at Qwen3-0.6B shapes, and vs
its floor (bytes / measured copy bandwidth, FLOPs / measured bf16 matmul rate).

    python bench/kernels.py [--json out.json]

Times are medians from triton.testing.do_bench (L2 flushed between runs). Triton kernels are
also timed replayed from a CUDA graph (do_bench_cudagraph, as the engine runs decode), which
hides the Python launch cost that dominates microsecond kernels, and in an eager loop, which
shows that cost.
"""
import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch
import triton
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.kernels.activation import silu_and_mul, silu_and_mul_ref  # noqa: E402
from engine.kernels.attention_probe import attention_probs, attention_probs_ref  # noqa: E402
from engine.kernels.lens_stats import lens_stats, lens_stats_ref, sampled_stats, sampled_stats_ref  # noqa: E402
from engine.kernels.decode_attention import paged_decode_attention, paged_decode_attention_ref  # noqa: E402
from engine.kernels.prefill_attention import paged_prefill_attention, paged_prefill_attention_ref  # noqa: E402
from engine.kernels.rmsnorm import fused_add_rms_norm, fused_add_rms_norm_ref, rms_norm, rms_norm_ref  # noqa: E402
from engine.kernels.rotary import apply_rotary, apply_rotary_ref, build_cos_sin_cache  # noqa: E402
from engine.kernels.sampling_kernel import gumbel_argmax  # noqa: E402
from engine.sampling import uniform_noise  # noqa: E402
from engine.kernels.store_kvcache import store_kvcache, store_kvcache_ref  # noqa: E402

# Qwen3-0.6B
HIDDEN, INTER, HQ, HKV, D = 1024, 3072, 16, 8, 128
VOCAB = 151936
BLOCK_SIZE = 16
MAX_MODEL_LEN = 4096
BF16 = torch.bfloat16
E = 2  # bytes per bf16 element


def median_us(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3


def graph_us(fn) -> float | None:
    try:
        return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e3
    except Exception:  # not capturable (e.g. a host sync)
        return None


def loop_us(fn, calls: int = 200) -> float:
    """Back-to-back eager calls, one sync at the end: max(host launch cost, device time) per call."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def measure_floors() -> dict:
    """Device-to-device copy bandwidth and bf16 matmul rate, measured now on this device."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")  # 1 GiB
    dst = torch.empty_like(src)
    copy_s = triton.testing.do_bench(lambda: dst.copy_(src), warmup=10, rep=200, return_mode="median") * 1e-3
    del src, dst
    n = 8192
    a = torch.randn(n, n, dtype=BF16, device="cuda")
    b = torch.randn(n, n, dtype=BF16, device="cuda")
    mm_s = triton.testing.do_bench(lambda: a @ b, warmup=10, rep=200, return_mode="median") * 1e-3
    return {"copy_bytes_per_s": 2 * (1 << 30) / copy_s, "matmul_flops_per_s": 2 * n**3 / mm_s}


def paged_kv(batch: int, context: int):
    """A bf16 paged cache holding `batch` sequences of `context` tokens in shuffled blocks."""
    per_seq = triton.cdiv(context, BLOCK_SIZE)
    num_blocks = batch * per_seq
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, HKV, D, dtype=BF16, device="cuda")
    v_cache = torch.randn_like(k_cache)
    tables = torch.full((batch, MAX_MODEL_LEN // BLOCK_SIZE), -1, dtype=torch.int32, device="cuda")
    tables[:, :per_seq] = torch.randperm(num_blocks, dtype=torch.int32, device="cuda").view(batch, per_seq)
    return k_cache, v_cache, tables


def _torch_race(logits, temp, seeds, positions):
    """What engine.sampling.sample ran for plain temperature rows before the fused kernel."""
    probs = torch.softmax(logits / temp.clamp_min(1e-6)[:, None], dim=-1)
    e = -torch.log(uniform_noise(seeds, positions, logits.shape[-1]))
    return torch.where(temp == 0, logits.argmax(dim=-1), (probs / e).argmax(dim=-1))


def cases():
    """(kernel, shape, triton fn, ref fn, bytes moved, flops) at Qwen3-0.6B shapes."""
    dev = "cuda"
    for n in (1, 256, 1024):  # tokens in a step: batch-1 decode, batch-256 decode, 1k prefill
        x = torch.randn(n, HIDDEN, dtype=BF16, device=dev)
        r = torch.randn_like(x)
        w = torch.randn(HIDDEN, dtype=BF16, device=dev)
        yield ("rms_norm", f"N={n} H={HIDDEN}", lambda x=x, w=w: rms_norm(x, w, 1e-6),
               lambda x=x, w=w: rms_norm_ref(x, w, 1e-6), 2 * n * HIDDEN * E, 0)
        yield ("fused_add_rms_norm", f"N={n} H={HIDDEN}", lambda x=x, r=r, w=w: fused_add_rms_norm(x, r, w, 1e-6),
               lambda x=x, r=r, w=w: fused_add_rms_norm_ref(x, r, w, 1e-6), 4 * n * HIDDEN * E, 0)
        qkv = torch.randn(n, (HQ + 2 * HKV) * D, dtype=BF16, device=dev)
        q = qkv[:, :HQ * D].view(n, HQ, D)
        k = qkv[:, HQ * D:(HQ + HKV) * D].view(n, HKV, D)
        v = qkv[:, (HQ + HKV) * D:].view(n, HKV, D)
        qn = torch.randn(D, dtype=BF16, device=dev)
        yield ("rms_norm (q-norm)", f"N={n} x {HQ} heads D={D}", lambda q=q, qn=qn: rms_norm(q, qn, 1e-6),
               lambda q=q, qn=qn: rms_norm_ref(q, qn, 1e-6), 2 * n * HQ * D * E, 0)
        cache = build_cos_sin_cache(D, MAX_MODEL_LEN, 1e6, dev)
        pos = torch.randint(0, MAX_MODEL_LEN, (n,), device=dev)
        yield ("apply_rotary", f"N={n} {HQ}q/{HKV}kv D={D}", lambda q=q, k=k, pos=pos: apply_rotary(q, k, pos, cache),
               lambda q=q, k=k, pos=pos: apply_rotary_ref(q, k, pos, cache), 2 * n * (HQ + HKV) * D * E + n * D * 4, 0)
        gate_up = torch.randn(n, 2 * INTER, dtype=BF16, device=dev)
        yield ("silu_and_mul", f"N={n} I={INTER}", lambda g=gate_up: silu_and_mul(g),
               lambda g=gate_up: silu_and_mul_ref(g), 3 * n * INTER * E, 0)
        kc = torch.empty(2048, BLOCK_SIZE, HKV, D, dtype=BF16, device=dev)
        vc = torch.empty_like(kc)
        slots = torch.randperm(2048 * BLOCK_SIZE, device=dev)[:n]
        yield ("store_kvcache", f"N={n} {HKV}kv D={D} bs={BLOCK_SIZE}",
               lambda k=k, v=v, kc=kc, vc=vc, s=slots: store_kvcache(k, v, kc, vc, s),
               lambda k=k, v=v, kc=kc, vc=vc, s=slots: store_kvcache_ref(k, v, kc, vc, s), 4 * n * HKV * D * E, 0)

    scale = D**-0.5
    for batch in (1, 64, 256):
        for context in (512, 2048):
            k_cache, v_cache, tables = paged_kv(batch, context)
            ctx = torch.full((batch,), context, dtype=torch.int32, device=dev)
            q = torch.randn(batch, HQ, D, dtype=BF16, device=dev)
            out = torch.empty_like(q)
            kv_bytes = 2 * batch * context * HKV * D * E
            yield ("paged_decode_attention", f"B={batch} ctx={context} {HQ}q/{HKV}kv bs={BLOCK_SIZE}",
                   lambda a=(q, k_cache, v_cache, tables, ctx, scale), o=out: paged_decode_attention(*a, out=o),
                   lambda a=(q, k_cache, v_cache, tables, ctx, scale): paged_decode_attention_ref(*a),
                   kv_bytes + 2 * q.numel() * E, 4 * batch * HQ * context * D)
            del k_cache, v_cache

    for q_len, context in ((1024, 1024), (128, 2048)):  # a 1k prompt; a chunk after a cached prefix
        k_cache, v_cache, tables = paged_kv(1, context)
        q = torch.randn(q_len, HQ, D, dtype=BF16, device=dev)
        cu = torch.tensor([0, q_len], dtype=torch.int32, device=dev)
        ctx = torch.tensor([context], dtype=torch.int32, device=dev)
        pairs = sum(context - q_len + j + 1 for j in range(q_len))  # causal (query, key) pairs
        yield ("paged_prefill_attention", f"q={q_len} ctx={context} {HQ}q/{HKV}kv bs={BLOCK_SIZE}",
               lambda a=(q, k_cache, v_cache, cu, ctx, tables, scale, q_len): paged_prefill_attention(*a),
               lambda a=(q, k_cache, v_cache, cu, ctx, tables, scale, q_len): paged_prefill_attention_ref(*a),
               2 * context * HKV * D * E + 2 * q.numel() * E, 4 * HQ * D * pairs)

    for context in (512, 2048):
        k_cache, _, tables = paged_kv(1, context)
        q = torch.randn(HQ, D, dtype=BF16, device=dev)
        length = torch.tensor([context], dtype=torch.int32, device=dev)
        probs = torch.empty(HQ, MAX_MODEL_LEN, dtype=torch.float32, device=dev)
        yield ("attention_probs", f"ctx={context} max={MAX_MODEL_LEN} {HQ}q/{HKV}kv",
               lambda a=(q, k_cache, tables[0], length, scale, probs): attention_probs(*a),
               lambda a=(q, k_cache, tables[0], length, scale, probs): attention_probs_ref(*a),
               context * HKV * D * E + 3 * probs.numel() * 4, 2 * HQ * context * D)


    # the logit lens of one watched token: 28 layers' rows through the LM head, top-10
    lens_logits = torch.randn(28, VOCAB, device=dev).to(BF16)
    yield ("lens_stats", f"R=28 V={VOCAB} bf16 k=10", lambda x=lens_logits: lens_stats(x, 10),
           lambda x=lens_logits: lens_stats_ref(x, 10), lens_logits.numel() * E, 0)
    # after sampling: the sampled token's probability and rank in each lens row
    lens_lse = torch.logsumexp(lens_logits.float(), -1).view(28, 1)
    sampled = torch.tensor([123], device=dev)
    args = (lens_logits.view(28, 1, VOCAB), lens_lse, sampled)
    yield ("sampled_stats", f"L=28 W=1 V={VOCAB} bf16", lambda a=args: sampled_stats(*a),
           lambda a=args: sampled_stats_ref(*a), lens_logits.numel() * E, 0)

    for batch in (1, 128, 256):  # the sampler at decode: fp32 logits, half the rows greedy
        logits = torch.randn(batch, VOCAB, device=dev)
        temp = (torch.arange(batch, device=dev) % 2).float() * 0.8
        seeds = torch.randint(0, 2**62, (batch,), device=dev)
        pos = torch.randint(0, MAX_MODEL_LEN, (batch,), device=dev)
        args = (logits, temp, seeds, pos)
        yield ("gumbel_argmax (sampler)", f"B={batch} V={VOCAB} fp32 half greedy", lambda a=args: gumbel_argmax(*a),
               lambda a=args: _torch_race(*a), batch * VOCAB * 4, 0)


def main(out_json: str | None = None, only: str | None = None) -> list[dict]:
    if not torch.cuda.is_available():
        raise SystemExit("bench/kernels.py needs a CUDA GPU")
    floors = measure_floors()
    device = torch.cuda.get_device_name()
    print(f"# {datetime.date.today()} {device}  torch {torch.__version__}  triton {triton.__version__}")
    print(f"# floors: copy {floors['copy_bytes_per_s'] / 1e12:.2f} TB/s, "
          f"bf16 matmul {floors['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s")
    header = (f"{'kernel':<24} {'shape':<34} {'triton us':>10} {'graph us':>9} {'loop us':>8} {'torch us':>10} "
              f"{'speedup':>8} {'floor us':>9} {'% floor':>8}")
    print(header)
    print("-" * len(header))
    rows = []
    for name, shape, fn, ref, nbytes, flops in cases():
        if only and only not in name:
            continue
        fn()  # compile outside the timing
        t_us = median_us(fn)
        g_us = graph_us(fn)
        l_us = loop_us(fn)
        ref_us = median_us(ref)
        floor_us = max(nbytes / floors["copy_bytes_per_s"], flops / floors["matmul_flops_per_s"]) * 1e6
        best = min(t for t in (t_us, g_us) if t is not None)
        row = dict(kernel=name, shape=shape, triton_us=t_us, triton_graph_us=g_us, triton_loop_us=l_us, torch_us=ref_us,
                   speedup=ref_us / t_us, floor_us=floor_us, pct_of_floor=100 * floor_us / best,
                   bytes=nbytes, flops=flops, device=device)
        rows.append(row)
        g = f"{g_us:9.1f}" if g_us is not None else f"{'-':>9}"
        print(f"{name:<24} {shape:<34} {t_us:10.1f} {g} {l_us:8.1f} {ref_us:10.1f} {row['speedup']:7.1f}x "
              f"{floor_us:9.2f} {row['pct_of_floor']:7.0f}%", flush=True)
    print("# triton/torch us: do_bench median, L2 flushed; graph us: replayed from a CUDA graph (warm L2);")
    print("# loop us: back-to-back eager calls (host launch cost shows here); % floor = floor / best of")
    print("# (triton, graph): 100% = at the measured copy bandwidth / matmul rate")
    if out_json:
        Path(out_json).parent.mkdir(parents=True, exist_ok=True)
        Path(out_json).write_text(json.dumps({"floors": floors, "rows": rows}, indent=1))
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None, help="also write the rows to this JSON file")
    parser.add_argument("--only", default=None, help="only the kernels whose name holds this")
    a = parser.parse_args()
    main(a.json, a.only)
