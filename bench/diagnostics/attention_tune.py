"""Sweep the paged decode-attention kernel's launch parameters at serving batch sizes.

    python bench/diagnostics/attention_tune.py [--batches 64 128 256] [--contexts 512 1024] [--heads 32 4]
                                   [--splits 2 4]

At Qwen3-0.6B shapes (16 query / 8 KV heads, head_dim 128; --heads 32 4 for Qwen3-30B-A3B's, 16-token blocks scattered over a
large cache, as a busy engine's are), per (batch, context): µs per call and the KV bytes read
per second for the split count the engine picks and for the others, and for each launch
config (passed to the kernel as `launch=`); each variant checked against the torch reference
first. A diagnostic: it prints a table and the best config per shape, it changes nothing.
"""
from __future__ import annotations

import itertools
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

from engine.kernels import decode_attention as DA

HQ, HKV, D, BS = 16, 8, 128, 16


def make_case(batch: int, context: int, gen: torch.Generator, dtype=torch.bfloat16, dev="cuda",
              hq: int = HQ, hkv: int = HKV):
    lens = torch.randint(context // 2, context * 3 // 2 + 1, (batch,), generator=gen)
    width = int(-(-int(lens.max()) // BS))
    num_blocks = batch * width + 1
    k = torch.randn(num_blocks, BS, hkv, D, generator=gen).to(dev, dtype)
    v = torch.randn(num_blocks, BS, hkv, D, generator=gen).to(dev, dtype)
    tables = torch.randperm(num_blocks - 1, generator=gen)[:batch * width].view(batch, width)
    q = torch.randn(batch, hq, D, generator=gen).to(dev, dtype)
    return q, k, v, tables.to(dev, torch.int32), lens.to(dev, torch.int32)


def time_us(fn, iters: int = 50) -> float:
    fn()
    if not torch.cuda.is_available():        # --smoke on the CPU (Triton's interpreter)
        import time
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(iters):
            fn()
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(3):
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b) * 1e3 / iters)
    return best


def main(argv=None) -> None:
    import argparse
    p = argparse.ArgumentParser()
    p.add_argument("--batches", type=int, nargs="+", default=[64, 128, 256])
    p.add_argument("--contexts", type=int, nargs="+", default=[512, 1024])
    p.add_argument("--heads", type=int, nargs=2, default=[HQ, HKV], metavar=("Q", "KV"))
    p.add_argument("--splits", type=int, nargs="+", default=[2, 4],
                   help="split counts the split-path variants try (each with 32/64/128-token tiles)")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, two variants")
    a = p.parse_args(argv)
    hq, hkv = a.heads
    dev, dtype = ("cpu", torch.float32) if a.smoke else ("cuda", torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    variants = []
    for bn, w, st in itertools.product((32, 64, 128), (4, 8), (2, 3, 4)):
        variants.append((1, dict(BLOCK_N=bn, num_warps=w, num_stages=st)))
    for sp, bn, st in itertools.product(a.splits, (32, 64, 128), (2, 3)):
        variants.append((sp, dict(BLOCK_N=bn, num_warps=4, num_stages=st)))
    if a.smoke:
        variants = [variants[0], variants[-1]]
    print(f"# heads {hq} / {hkv}, head_dim {D}")
    print(f"{'batch':>5} {'ctx':>5} {'splits':>6} {'config':<28} {'us':>8} {'TB/s':>6} {'err':>8}")
    for batch, context in itertools.product(a.batches, a.contexts):
        q, k, v, tables, lens = make_case(batch, context, gen, dtype, dev, hq, hkv)
        scale = D ** -0.5
        ref = DA.paged_decode_attention_ref(q, k, v, tables, lens, scale).float()
        nbytes = int(lens.sum()) * hkv * D * 2 * k.element_size()
        picked = DA.choose_num_splits(batch, hkv, tables.shape[1] * BS, q.device)
        rows = []
        for splits, cfg in variants:
            out = torch.empty_like(q)
            try:
                fn = lambda: DA.paged_decode_attention(q, k, v, tables, lens, scale, out=out,  # noqa: E731
                                                       num_splits=splits, launch=cfg)
                fn()
                err = float((out.float() - ref).abs().max())
                us = time_us(fn)
            except Exception as e:   # noqa: BLE001 — a config that does not compile or fit
                print(f"{batch:>5} {context:>5} {splits:>6} {str(cfg):<28} failed: {e!r}"[:160])
                continue
            rows.append((us, splits, cfg, err))
        # the engine's own choice today
        out = torch.empty_like(q)
        cur = time_us(lambda: DA.paged_decode_attention(q, k, v, tables, lens, scale, out=out))
        for us, splits, cfg, err in sorted(rows, key=lambda r: r[0])[:6]:
            short = f"n{cfg['BLOCK_N']} w{cfg['num_warps']} st{cfg['num_stages']}"
            print(f"{batch:>5} {context:>5} {splits:>6} {short:<28} {us:8.1f} {nbytes / us / 1e6:6.2f} {err:8.1e}")
        today = DA.launch_config(batch * hkv, picked, tables.shape[1] * BS)
        print(f"{batch:>5} {context:>5} {picked:>6} {'engine today ' + str(today):<28} "
              f"{cur:8.1f} {nbytes / cur / 1e6:6.2f}")
        bad = [r for r in rows if r[3] > 3e-2]
        if bad:
            print(f"  !! {len(bad)} variants off the reference by > 3e-2: {bad[:2]}")


if __name__ == "__main__":
    main()
