"""Decode attention at small batches: the split count and the merge, at both models' head shapes.

    python bench/attention_splits.py [--batches 1 4 16] [--contexts 256 512 1024]
    TRITON_INTERPRET=1 python bench/attention_splits.py --smoke   # CPU, tiny shapes

Per (heads, batch, context), µs per call of `paged_decode_attention` (48 calls in a row in one
CUDA graph, chained by PDL as the engine's layers are) for split counts 4 / 8 / 16 / 32, the
engine's unbounded choice and the choice of the context bound a decode graph would replay
(`decode_attention.context_caps`), each with the merge of a query-head group one head after
another and all heads at once (`MERGE_HEADS_TOGETHER`). Every output is checked against the
torch reference. A diagnostic: it prints a table and changes nothing.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.decode_chain import time_eager, time_graph
from engine.kernels import decode_attention as DA

D, PAGE, WIDTH = 128, 16, 257      # head_dim, block size, the engine's graph table width (4,096 tokens)
HEADS = ((16, 8), (32, 4))         # Qwen3-0.6B, Qwen3-30B-A3B (query heads, KV heads)
SPLITS = (4, 8, 16, 32)


def make_case(batch, hq, hkv, ctx, g, d, width, dev, dtype):
    nb = 2 * width * batch
    k = torch.randn(nb, PAGE, hkv, d, generator=g).to(dev, dtype)
    v = torch.randn(nb, PAGE, hkv, d, generator=g).to(dev, dtype)
    tables = torch.randperm(nb, generator=g)[:batch * width].view(batch, width).to(dev, torch.int32)
    q = torch.randn(batch, hq, d, generator=g).to(dev, dtype)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
    return q, k, v, tables, lens


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--contexts", type=int, nargs="+", default=[256, 512, 1024])
    p.add_argument("--calls", type=int, default=48, help="calls in a row per timing")
    p.add_argument("--smoke", action="store_true", help="CPU (interpreter), tiny shapes")
    a = p.parse_args(argv)
    if a.smoke:
        dev, dtype, d, width, timer = "cpu", torch.float32, 32, 4, time_eager
        heads, splits, a.batches, a.contexts, a.calls = ((4, 2),), (2,), [1], [40], 1
    else:
        dev, dtype, d, width, timer, heads, splits = "cuda", torch.bfloat16, D, WIDTH, time_graph, HEADS, SPLITS
    g = torch.Generator().manual_seed(0)
    merge0 = DA.MERGE_HEADS_TOGETHER
    print("| heads q/kv | batch | context | splits: unbounded / bounded | merge | "
          + " | ".join(f"{s} splits" for s in splits) + " | unbounded | bounded |")
    print("| --- " * (7 + len(splits)) + "|")
    try:
        for hq, hkv in heads:
            for batch in a.batches:
                for ctx in a.contexts:
                    q, k, v, tables, lens = make_case(batch, hq, hkv, ctx, g, d, width, dev, dtype)
                    out = torch.empty_like(q)
                    ref = DA.paged_decode_attention_ref(q, k, v, tables, lens, d ** -0.5).float()
                    dv = torch.device(dev)
                    full = DA.choose_num_splits(batch, hkv, width * PAGE, dv)
                    cap = next((c for c in DA.context_caps(batch, hkv, width * PAGE, dv) if ctx <= c), None)
                    bounded = DA.choose_num_splits(batch, hkv, cap or width * PAGE, dv)
                    for merge in (False, True):
                        DA.MERGE_HEADS_TOGETHER = merge
                        cells = []
                        for s in (*splits, full, bounded):
                            def fn(s=s):
                                for _ in range(a.calls):
                                    DA.paged_decode_attention(q, k, v, tables, lens, d ** -0.5, out=out,
                                                              num_splits=s)
                            us = timer(fn, 10) / a.calls
                            err = float((out.float() - ref).abs().max())
                            cells.append(f"{us:.2f}" + ("" if err < 3e-2 else f" (off by {err:.1e})"))
                        print(f"| {hq}/{hkv} | {batch} | {ctx} | {full} / {bounded} (bound {cap}) | "
                              f"{'heads together' if merge else 'per head'} | " + " | ".join(cells) + " |",
                              flush=True)
    finally:
        DA.MERGE_HEADS_TOGETHER = merge0


if __name__ == "__main__":
    main()
