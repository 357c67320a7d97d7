"""Microbenchmark: skinny_linear (Triton, M <= 8) vs torch.nn.functional.linear (cuBLAS) at the
decode shapes of Qwen3-0.6B and the dense part of Qwen3-30B-A3B, in bf16.

Every timing is a CUDA graph of back-to-back calls replayed several times, as in the engine's
decode graphs, so launch overhead from Python is excluded. Each call in the graph reads its own
copy of the weight, and the copies together span >= 2x the L2, so no call finds its weight still
cached by the previous ones (a real forward reads each layer's weights once per token).

    python bench/diagnostics/skinny_gemm.py              # table: torch, heuristic, best of the sweep (< 90 s on an H200)
    python bench/diagnostics/skinny_gemm.py --no-sweep   # torch and heuristic only
    python bench/diagnostics/skinny_gemm.py --smoke      # CPU (Triton interpreter) or GPU: tiny correctness pass
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import torch

if not torch.cuda.is_available():  # before triton is imported: CPU runs use the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench.common import graph_us  # noqa: E402
from engine.kernels.skinny_gemm import SkinnyConfig, fma_acc_regs, pick_config, skinny_linear, skinny_linear_ref  # noqa: E402

SHAPES = [  # (name, N, K): weight [N, K]
    ("0.6B qkv", 4096, 1024),
    ("0.6B o_proj", 1024, 2048),
    ("0.6B gate_up", 6144, 1024),
    ("0.6B down", 1024, 3072),
    ("0.6B lm_head", 151936, 1024),
    ("30B qkv", 5120, 2048),
    ("30B o_proj", 2048, 4096),
]
MS = [1, 2, 4, 8]
CALLS = 20  # calls per graph (more when more weight copies are needed to defeat L2)
REPLAYS = 10

C = SkinnyConfig
# Alternatives timed beside the heuristic (each config won or came close somewhere in a --wide run
# on an H200): FMA at several row/K blockings and widths, tensor-core tiles, split-K for small N.
SWEEP = [
    C(4, 512, 1, 2, 3), C(2, 512, 1, 2, 3), C(2, 1024, 1, 4, 3), C(1, 1024, 1, 4, 3),
    C(2, 1024, 1, 2, 3), C(4, 1024, 1, 4, 3), C(2, 2048, 1, 8, 3), C(1, 2048, 1, 8, 3),
    C(64, 256, 1, 4, 4, True), C(64, 256, 1, 4, 3, True), C(128, 128, 1, 4, 3, True),
    C(64, 128, 1, 4, 4, True), C(32, 256, 1, 4, 4, True), C(64, 256, 4, 4, 3, True),
    C(64, 128, 4, 4, 3, True), C(32, 256, 4, 4, 3, True), C(64, 256, 2, 4, 3, True),
]


def wide_grid() -> list[SkinnyConfig]:
    """A broader grid (~60 configs, a few minutes) for retuning pick_config on a new GPU."""
    grid = []
    for w in (2, 4, 8):
        for bk in (256 * w, 512 * w):  # whole 16-byte vectors per thread, all warps along K
            for bn in (1, 2, 4, 8, 16):
                if bn * bk * 2 <= 65536:
                    grid.append(C(bn, bk, 1, w, 3))
    grid += [C(bn, 1024, s, 4, 3) for bn in (2, 4) for s in (2, 4)]
    for bn in (16, 32, 64, 128):
        for bk in (64, 128, 256):
            if bn * bk * 2 <= 32768:
                grid.append(C(bn, bk, 1, 4, 3, True))
    grid += [C(bn, bk, 1, 4, st, True) for bn, bk in ((64, 128), (32, 256), (64, 256)) for st in (2, 4)]
    grid += [C(bn, bk, s, 4, 3, True) for bn, bk in ((64, 128), (64, 256), (32, 256), (16, 256)) for s in (2, 4)]
    return grid


def copy_bandwidth() -> float:
    """Device copy rate in bytes/s counting read + write, the ceiling for a weight stream."""
    src = torch.empty(2**28, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    return 2 * src.numel() * src.element_size() / statistics.median(times)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12)).item()


def bench_one(name, x, ws, n_calls, sweep, num_sms) -> dict:
    """Time torch, the heuristic and every sweep config for one (shape, M); x [M, K], ws: weight copies."""
    M, (N, K) = x.shape[0], ws[0].shape
    ref = skinny_linear_ref(x, ws[0])

    def timed(fn) -> float:
        return graph_us([lambda i=i: fn(x, ws[i % len(ws)]) for i in range(n_calls)], REPLAYS)

    torch_us = timed(torch.nn.functional.linear)
    heur = pick_config(M, N, K, 2, num_sms)
    heur_us = timed(lambda a, w: skinny_linear(a, w, config=heur))
    heur_err = rel_err(skinny_linear(x, ws[0], config=heur), ref)
    best_us, best_cfg, fails, times = heur_us, heur, [], {heur.short(): heur_us}
    for cfg in sweep:
        if cfg == heur or fma_acc_regs(cfg, M) > 128:  # would spill: not worth timing
            continue
        try:
            err = rel_err(skinny_linear(x, ws[0], config=cfg), ref)
            if not err < 2e-2:
                fails.append(f"{cfg.short()}: rel err {err:.1e}")
                continue
            us = timed(lambda a, w, cfg=cfg: skinny_linear(a, w, config=cfg))
        except Exception as exc:  # e.g. out of shared memory: report, go on
            fails.append(f"{cfg.short()}: {type(exc).__name__} {str(exc)[:60]}")
            continue
        times[cfg.short()] = us
        if us < best_us:
            best_us, best_cfg = us, cfg
    return {"shape": name, "N": N, "K": K, "M": M, "torch_us": torch_us, "heur_us": heur_us,
            "best_us": best_us, "heur_config": heur.short(), "best_config": best_cfg.short(),
            "heur_rel_err": heur_err, "speedup_vs_torch": torch_us / best_us, "failures": fails, "times": times}


def bench(sweep: list[SkinnyConfig], ms: list[int], shapes, out_json: str | None) -> list[dict]:
    torch.manual_seed(0)
    bw = copy_bandwidth()
    props = torch.cuda.get_device_properties(0)
    l2 = getattr(props, "L2_cache_size", 50 * 2**20) or 50 * 2**20
    print(f"device {props.name}: {props.multi_processor_count} SMs, L2 {l2 / 2**20:.0f} MiB, "
          f"copy {bw / 1e12:.2f} TB/s; µs per call inside a CUDA graph, TB/s = weight bytes / time; "
          f"floor = weight bytes / copy rate")
    print(f"{'shape':<13} {'N':>6} {'K':>5} {'M':>2} | {'torch':>6} {'TB/s':>5} | {'heur':>6} {'TB/s':>5} | "
          f"{'best':>6} {'TB/s':>5} {'floor':>6} | best config (heuristic config)")
    rows = []
    t0 = time.time()
    for name, N, K in shapes:
        wbytes = N * K * 2
        copies = max(1, min(40, math.ceil(2 * l2 / wbytes)))  # >= 2x L2 of distinct weights per graph
        ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K**0.5 for _ in range(copies)]
        for M in ms:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            row = bench_one(name, x, ws, max(CALLS, copies), sweep, props.multi_processor_count)
            row["floor_us"] = wbytes / bw * 1e6  # bw counts read + write bytes: the rate bytes move at
            rows.append(row)
            tb = {k: wbytes / (row[k] * 1e-6) / 1e12 for k in ("torch_us", "heur_us", "best_us")}
            flag = f"  HEUR ERR {row['heur_rel_err']:.1e}" if row["heur_rel_err"] > 2e-2 else ""
            print(f"{name:<13} {N:>6} {K:>5} {M:>2} | {row['torch_us']:>6.2f} {tb['torch_us']:>5.2f} | "
                  f"{row['heur_us']:>6.2f} {tb['heur_us']:>5.2f} | {row['best_us']:>6.2f} "
                  f"{tb['best_us']:>5.2f} {row['floor_us']:>6.2f} | {row['best_config']} "
                  f"({row['heur_config']}){flag}")
            for f in row["failures"]:
                print(f"    failed {f}")
        ws.clear()
        torch.cuda.empty_cache()
    print(f"done in {time.time() - t0:.0f} s")
    if out_json:
        with open(out_json, "w") as f:
            json.dump({"device": props.name, "copy_bw": bw, "rows": rows}, f, indent=1)
    return rows


def smoke() -> None:
    """Tiny shapes, heuristic and two sweep configs, checked against the reference (no timing)."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(0)
    cfgs = [None, C(16, 64, 1, 4, 2), C(16, 32, 2, 4, 2, True)]
    for N, K in [(40, 96)]:
        w = torch.randn(N, K, generator=g).to(dev)
        for M in (1, 3):
            x = torch.randn(M, K, generator=g).to(dev)
            ref = skinny_linear_ref(x, w)
            for cfg in cfgs:
                err = rel_err(skinny_linear(x, w, config=cfg), ref)
                assert err < 1e-5, (N, K, M, cfg, err)
    print(f"smoke ok ({dev}): {len(cfgs)} configs x M in (1, 3), fp32, against F.linear")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny correctness-only pass (CPU ok)")
    p.add_argument("--no-sweep", action="store_true", help="time torch and the heuristic only")
    p.add_argument("--wide", action="store_true", help="sweep wide_grid() instead (slow: retuning only)")
    p.add_argument("--m", type=int, nargs="+", default=MS, help="batch sizes (rows of x)")
    p.add_argument("--shapes", default=None, help="comma-separated substrings of shape names to keep")
    p.add_argument("--out-json", default=None)
    args = p.parse_args()
    if args.smoke:
        smoke()
        return
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU (use --smoke on a CPU)")
    shapes = SHAPES if not args.shapes else [s for s in SHAPES if any(k in s[0] for k in args.shapes.split(","))]
    bench([] if args.no_sweep else wide_grid() if args.wide else SWEEP, args.m, shapes, args.out_json)


if __name__ == "__main__":
    main()
