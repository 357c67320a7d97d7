"""Microbenchmark: fused_moe vs its torch reference at Qwen3-30B-A3B shapes, against the memory/compute floor."""

import argparse
import json
import os
import sys

import torch
from triton.testing import do_bench, do_bench_cudagraph

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.kernels.fused_moe import MoEKernelConfig, fused_moe, fused_moe_ref, pick_config  # noqa: E402
from engine.kernels.moe_align import _moe_align_torch, _moe_align_triton  # noqa: E402
from engine.kernels.moe_routing import route, route_ref  # noqa: E402

E, K, H, I = 128, 8, 2048, 768  # Qwen3-30B-A3B: 128 experts, top-8, hidden 2048, moe_intermediate 768
TOKENS = [1, 8, 64, 256, 1024, 4096]
LAYERS = 48
# Distinct weight sets cycled per timed call, so the experts a call touches are not still in L2
# from the previous call (a real forward reads each layer's experts once).
COPIES = 4

SWEEP = [
    MoEKernelConfig(16, 32, 64, 128, 1, 4, 4),
    MoEKernelConfig(16, 16, 32, 128, 1, 4, 4),
    MoEKernelConfig(16, 32, 32, 256, 1, 4, 3),
    MoEKernelConfig(16, 64, 64, 128, 1, 4, 4),
    MoEKernelConfig(16, 64, 128, 64, 8, 4, 4),
    MoEKernelConfig(32, 64, 128, 64, 8, 4, 4),
    MoEKernelConfig(64, 128, 128, 64, 8, 4, 3),
    MoEKernelConfig(64, 64, 128, 64, 8, 4, 4),
    MoEKernelConfig(128, 128, 128, 64, 8, 8, 3),
    MoEKernelConfig(128, 128, 128, 64, 8, 8, 4),
    MoEKernelConfig(128, 128, 256, 64, 8, 8, 3),
    MoEKernelConfig(128, 64, 128, 64, 8, 4, 4),
    MoEKernelConfig(64, 128, 128, 64, 8, 8, 4),
]


def _median_ms(fn, graph: bool) -> float:
    if graph:
        return do_bench_cudagraph(fn, rep=50, return_mode="median")
    return do_bench(fn, warmup=10, rep=100, return_mode="median")


def measure_floors() -> tuple[float, float]:
    """(device copy bandwidth in bytes/s counting read + write, bf16 matmul FLOP/s)."""
    src = torch.empty(2**28, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    bw = 2 * src.numel() * src.element_size() / (_median_ms(lambda: dst.copy_(src), False) * 1e-3)
    del src, dst
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    rate = 2 * 8192**3 / (_median_ms(lambda: a @ b, False) * 1e-3)
    return bw, rate


def _short(c: MoEKernelConfig) -> str:
    return f"bm{c.block_m} bn{c.block_n13}/{c.block_n2} bk{c.block_k} g{c.group_m} w{c.num_warps} s{c.num_stages}"


def main(out_json: str | None = None, sweep: bool = False) -> list[dict]:
    torch.manual_seed(0)
    bw, rate = measure_floors()
    print(f"device {torch.cuda.get_device_name()}: copy {bw / 1e12:.2f} TB/s, bf16 matmul {rate / 1e12:.0f} TFLOP/s")
    layers = [((torch.randn(E, 2 * I, H, device="cuda") / H**0.5).to(torch.bfloat16),
               (torch.randn(E, H, I, device="cuda") / I**0.5).to(torch.bfloat16)) for _ in range(COPIES)]
    expert_bytes = 3 * H * I * 2

    rows = []
    head = f"{'N':>5} {'fused graph':>11} {'eager':>8} {'ref':>9} {'floor':>8} {'%floor':>6} " \
           f"{'x ref':>6} {'route trit/torch':>16} {'align trit/torch':>16} {'experts':>7}  (µs)"
    print(head)
    for n in TOKENS:
        x = torch.randn(n, H, device="cuda").to(torch.bfloat16)
        logits = torch.randn(n, E, device="cuda").to(torch.bfloat16)
        _, w, ids = route(logits, K, True)
        out = torch.empty_like(x)
        cfg = pick_config(n, K, E)
        used = int(torch.unique(ids).numel())
        floor_s = max((used * expert_bytes + 2 * x.numel() * x.element_size()) / bw, 2 * n * K * 3 * H * I / rate)

        def run_fused(c=None):
            for w13, w2 in layers:
                fused_moe(x, w13, w2, w, ids, out=out, config=c)

        def run_ref():
            for w13, w2 in layers:
                fused_moe_ref(x, w13, w2, w, ids)

        run_fused()
        fused_us = _median_ms(run_fused, True) * 1e3 / COPIES
        eager_us = _median_ms(run_fused, False) * 1e3 / COPIES
        ref_us = _median_ms(run_ref, False) * 1e3 / COPIES
        route_us = _median_ms(lambda: route(logits, K, True), True) * 1e3
        route_torch_us = _median_ms(lambda: route_ref(logits, K, True), True) * 1e3
        align_tr = _median_ms(lambda: _moe_align_triton(ids, E, cfg.block_m), True) * 1e3
        align_to = _median_ms(lambda: _moe_align_torch(ids, E, cfg.block_m), True) * 1e3
        row = dict(num_tokens=n, fused_us=fused_us, fused_eager_us=eager_us, ref_us=ref_us,
                   floor_us=floor_s * 1e6, pct_of_floor=100 * floor_s * 1e6 / fused_us,
                   speedup_vs_ref=ref_us / fused_us, route_us=route_us, route_torch_us=route_torch_us,
                   align_triton_us=align_tr, align_torch_us=align_to, experts_used=used, config=_short(cfg))
        rows.append(row)
        route_col = f"{route_us:.1f} / {route_torch_us:.1f}"
        align_col = f"{align_tr:.1f} / {align_to:.1f}"
        print(f"{n:>5} {fused_us:>11.1f} {eager_us:>8.1f} {ref_us:>9.1f} {row['floor_us']:>8.1f} "
              f"{row['pct_of_floor']:>5.0f}% {row['speedup_vs_ref']:>5.1f}x {route_col:>16} {align_col:>16} {used:>7}")
        if sweep:
            for c in SWEEP:
                try:
                    run_fused(c)
                    us = _median_ms(lambda: run_fused(c), True) * 1e3 / COPIES
                    print(f"        sweep {_short(c)}: {us:.1f} µs")
                except Exception as exc:  # out of shared memory etc.: report and go on
                    print(f"        sweep {_short(c)}: failed {type(exc).__name__}: {str(exc)[:80]}")
    us1 = rows[0]["fused_us"] + rows[0]["route_us"]
    print(f"batch-1 decode: route+experts {us1:.1f} µs/layer -> {LAYERS} layers {LAYERS * us1 / 1e3:.2f} ms/token "
          f"(MoE alone caps decode at {1e6 / (LAYERS * us1):.0f} tok/s)")
    if out_json:
        with open(out_json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), copy_bw=bw, matmul_flops=rate, rows=rows), f, indent=1)
    return rows


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out-json", default=None)
    p.add_argument("--sweep", action="store_true", help="also time a few alternative tile configs per N")
    args = p.parse_args()
    main(args.out_json, args.sweep)
