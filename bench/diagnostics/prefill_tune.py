"""Sweep the paged prefill-attention kernel's launch at long prompts against the FLOP floor.

    python bench/diagnostics/prefill_tune.py [--contexts 4096 16384 32768] [--chunk 8192]

At Qwen3-0.6B shapes (16 query / 8 KV heads, head_dim 128, 16-token blocks scattered over the
cache), the last chunk of a prompt of each context length (a whole 4k prompt is one chunk; at
16k and 32k the engine prefills in max_num_batched_tokens chunks): ms per call and causal
attention TFLOP/s for each launch (passed to the kernel as `launch=`), each checked against
the torch reference first. A diagnostic: it prints a table and the best launch per shape.
"""
from __future__ import annotations

import itertools
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

from bench.diagnostics.attention_tune import time_us
from engine.kernels import prefill_attention as PA

HQ, HKV, D, BS = 16, 8, 128, 16


def make_case(context: int, chunk: int, gen: torch.Generator, dtype, dev):
    q_len = min(chunk, context)
    width = -(-context // BS)
    k = torch.randn(width + 1, BS, HKV, D, generator=gen).to(dev, dtype)
    v = torch.randn(width + 1, BS, HKV, D, generator=gen).to(dev, dtype)
    tables = torch.randperm(width + 1, generator=gen)[:width].view(1, width)
    q = torch.randn(q_len, HQ, D, generator=gen).to(dev, dtype)
    cu = torch.tensor([0, q_len], dtype=torch.int32, device=dev)
    ctx = torch.tensor([context], dtype=torch.int32, device=dev)
    return q, k, v, cu, ctx, tables.to(dev, torch.int32), q_len


def causal_flops(context: int, q_len: int) -> float:
    """QK^T and PV over the keys each query sees (position + 1 of them), every query head."""
    first = context - q_len
    keys = q_len * (first + 1) + q_len * (q_len - 1) / 2
    return 4 * keys * HQ * D


def main(argv=None) -> None:
    import argparse
    p = argparse.ArgumentParser()
    p.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384, 32768])
    p.add_argument("--chunk", type=int, default=8192)
    p.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, two launches")
    a = p.parse_args(argv)
    dev, dtype = ("cpu", torch.float32) if a.smoke else ("cuda", torch.bfloat16)
    if a.smoke:
        a.contexts, a.chunk = [96], 64
    gen = torch.Generator().manual_seed(0)
    launches = [dict(PA.SHORT_LAUNCH), dict(PA.LONG_LAUNCH)]
    for m, n, w, st in itertools.product((64, 128, 256), (64, 128), (4, 8), (2, 3)):
        cfg = dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=st)
        if cfg not in launches and not (m == 256 and (n == 128 or w == 4)):
            launches.append(cfg)
    if a.smoke:
        launches = launches[:2]
    print(f"{'ctx':>6} {'q_len':>6} {'launch':<24} {'ms':>8} {'TFLOP/s':>8} {'err':>8}")
    for context in a.contexts:
        q, k, v, cu, ctx, tables, q_len = make_case(context, a.chunk, gen, dtype, dev)
        scale = D ** -0.5
        # the torch reference materialises every score (16 heads x q_len x context in fp32):
        # past 16k x 8k the short launch, checked against it at the smaller shapes, stands in
        ref = (PA.paged_prefill_attention_ref(q, k, v, cu, ctx, tables, scale, q_len)
               if context * q_len <= 16384 * 8192 else
               PA.paged_prefill_attention(q, k, v, cu, ctx, tables, scale, q_len,
                                          launch=PA.SHORT_LAUNCH)).float()
        flops = causal_flops(context, q_len)
        rows = []
        for cfg in launches:
            try:
                fn = lambda: PA.paged_prefill_attention(q, k, v, cu, ctx, tables, scale,  # noqa: E731
                                                        q_len, launch=cfg)
                err = float((fn().float() - ref).abs().max())
                us = time_us(fn, iters=5)
            except Exception as e:   # noqa: BLE001 — a launch that does not compile or fit
                print(f"{context:>6} {q_len:>6} {str(cfg):<24} failed: {e!r}"[:160])
                continue
            rows.append((us, cfg, err))
        today = PA.choose_launch(q_len)
        for us, cfg, err in sorted(rows, key=lambda r: r[0])[:8]:
            short = f"m{cfg['BLOCK_M']} n{cfg['BLOCK_N']} w{cfg['num_warps']} st{cfg['num_stages']}"
            mark = " <- engine" if cfg == today else ""
            print(f"{context:>6} {q_len:>6} {short:<24} {us / 1e3:8.3f} {flops / us / 1e6:8.1f} "
                  f"{err:8.1e}{mark}")
        mine = next((r for r in rows if r[1] == today), None)
        if mine:
            print(f"{context:>6} {q_len:>6} {'engine today':<24} {mine[0] / 1e3:8.3f} "
                  f"{flops / mine[0] / 1e6:8.1f}")
        bad = [r for r in rows if r[2] > 3e-2]
        if bad:
            print(f"  !! {len(bad)} launches off the reference by > 3e-2: {bad[:2]}")


if __name__ == "__main__":
    main()
