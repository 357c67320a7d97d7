"""Microbenchmark: the MoE expert kernels at Qwen3-30B-A3B shapes against their floor and the torch
reference — the path the engine picks (engine/layers/moe.py: tuned tables or defaults), and both
paths side by side (GEMV decode path up to 64 tokens, grouped GEMM path), plus the router (gate
GEMV + routing fused in one launch up to 64 tokens, vs the router linear + route kernel) and align.

Floor = max(active experts' bytes + x + out over the measured copy bandwidth, FLOPs over the
measured bf16 matmul rate). "graph" = µs per call inside a CUDA graph, cycling weight copies so
that no call finds its experts in L2.

    python bench/moe_kernels.py [--tp 2] [--out-json f.json]
"""

import argparse
import json
import os
import sys

import torch
from triton.testing import do_bench, do_bench_cudagraph

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.kernel_config import KernelConfig  # noqa: E402
from engine.kernels.fused_moe import fused_moe, fused_moe_ref  # noqa: E402
from engine.kernels.moe_align import _moe_align_torch, _moe_align_triton  # noqa: E402
from engine.kernels.moe_configs import (MoEGemvConfig, config_dir, config_file_name,  # noqa: E402
                                        default_gemv, default_grouped, device_name, pick_config)
from engine.kernels.moe_gemv import fused_moe_gemv  # noqa: E402
from engine.kernels.moe_routing import FUSED_MAX_TOKENS, route, route_counts, route_hidden, route_ref  # noqa: E402
from engine.layers.gemm import linear  # noqa: E402
from engine.layers.moe import fused_experts  # noqa: E402

E, K, H, I = 128, 8, 2048, 768  # Qwen3-30B-A3B: 128 experts, top-8, hidden 2048, moe_intermediate 768
TOKENS = [1, 2, 4, 8, 16, 64, 256, 1024, 4096]
GEMV_MAX = 64
LAYERS = 48
# Distinct weight sets cycled per timed call, so the experts a call touches are not still in L2
# from the previous call (a real forward reads each layer's experts once).
COPIES = 4


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


def main(out_json: str | None = None, tp: int = 1, ref: bool = True) -> list[dict]:
    torch.manual_seed(0)
    inter = I // tp
    bw, rate = measure_floors()
    dev = torch.device("cuda")
    kernels = KernelConfig.build()      # as an engine started here would (its table directory)
    table = config_dir(kernels.moe_config_dir) / config_file_name(E, inter, H, torch.bfloat16,
                                                                  device_name(dev))
    print(f"device {torch.cuda.get_device_name()}: copy {bw / 1e12:.2f} TB/s, bf16 matmul {rate / 1e12:.0f} "
          f"TFLOP/s; TP={tp} (I={inter}); configs: {table.name if table.is_file() else 'defaults (no table)'}")
    layers = [((torch.randn(E, 2 * inter, H, device="cuda") / H**0.5).to(torch.bfloat16),
               (torch.randn(E, H, inter, device="cuda") / inter**0.5).to(torch.bfloat16)) for _ in range(COPIES)]
    expert_bytes = 3 * H * inter * 2

    rows = []
    print(f"{'N':>5} {'path':>7} {'engine':>7} {'%floor':>6} | {'gemv':>6} {'%fl':>4} | {'grouped':>7} {'%fl':>4} | "
          f"{'floor':>6} {'ref':>8} {'router fused/2-step':>19} {'route trit/torch':>16} {'align':>5} {'experts':>7}  (µs)")
    for n in TOKENS:
        x = torch.randn(n, H, device="cuda").to(torch.bfloat16)
        logits = torch.randn(n, E, device="cuda").to(torch.bfloat16)
        _, w, ids = route(logits, K, True)
        out = torch.empty_like(x)
        cfg = pick_config(n, K, E, inter, H, torch.bfloat16, dev, kernels.moe_config_dir)
        used = int(torch.unique(ids).numel())
        floor_us = 1e6 * max((used * expert_bytes + 2 * x.numel() * x.element_size()) / bw,
                             2 * n * K * 3 * H * inter / rate)

        def graph_us(fn) -> float:
            def run():
                for w13, w2 in layers:
                    fn(w13, w2)
            run()  # compile outside the graph
            return _median_ms(run, True) * 1e3 / COPIES

        engine_us = graph_us(lambda w13, w2: fused_experts(x, w13, w2, w, ids, kernels=kernels))
        gemv_cfg = cfg if isinstance(cfg, MoEGemvConfig) else default_gemv(2)
        gemv_us = graph_us(lambda w13, w2: fused_moe_gemv(x, w13, w2, w, ids, out=out, config=gemv_cfg)) \
            if n <= GEMV_MAX else float("nan")
        grouped_cfg = None if isinstance(cfg, MoEGemvConfig) else cfg
        grouped_us = graph_us(lambda w13, w2: fused_moe(x, w13, w2, w, ids, out=out, config=grouped_cfg))
        ref_us = float("nan")
        if ref:
            w13, w2 = layers[0]
            ref_us = _median_ms(lambda: fused_moe_ref(x, w13, w2, w.to(x.dtype), ids), False) * 1e3
        route_us = _median_ms(lambda: route(logits, K, True), True) * 1e3
        gate = (torch.randn(E, H, device="cuda") / H**0.5).to(torch.bfloat16)
        two_step_us = _median_ms(lambda: route(linear(x, gate), K, True), True) * 1e3
        fused_router_us = float("nan")
        if n <= FUSED_MAX_TOKENS:
            counts = route_counts(dev)
            fused_router_us = _median_ms(lambda: route_hidden(x, gate, K, True, counts), True) * 1e3
        router_us = fused_router_us if n <= FUSED_MAX_TOKENS else two_step_us
        route_torch_us = _median_ms(lambda: route_ref(logits, K, True), True) * 1e3
        bm = (grouped_cfg or default_grouped(n, K, E)).block_m
        align_us = _median_ms(lambda: _moe_align_triton(ids, E, bm), True) * 1e3
        align_torch_us = _median_ms(lambda: _moe_align_torch(ids, E, bm), True) * 1e3
        pct = lambda us: 100 * floor_us / us  # noqa: E731
        row = dict(kernel="moe_experts", tp=tp, num_tokens=n, path=cfg.path, us=engine_us,
                   pct_of_floor=pct(engine_us), floor_us=floor_us, gemv_us=gemv_us, grouped_us=grouped_us,
                   ref_us=ref_us, router_us=router_us, router_fused_us=fused_router_us,
                   router_two_step_us=two_step_us, route_us=route_us, route_torch_us=route_torch_us, align_us=align_us,
                   align_torch_us=align_torch_us, experts_used=used, config=cfg.short())
        rows.append(row)
        print(f"{n:>5} {cfg.path:>7} {engine_us:7.1f} {pct(engine_us):5.0f}% | {gemv_us:6.1f} {pct(gemv_us):3.0f}% | "
              f"{grouped_us:7.1f} {pct(grouped_us):3.0f}% | {floor_us:6.1f} {ref_us:8.0f} "
              f"{f'{fused_router_us:.1f} / {two_step_us:.1f}':>19} "
              f"{f'{route_us:.1f} / {route_torch_us:.1f}':>16} {align_us:5.1f} {used:>7}")
    us1 = rows[0]["us"] + rows[0]["router_us"]
    print(f"batch-1 decode: router+experts {us1:.1f} µs/layer -> {LAYERS} layers {LAYERS * us1 / 1e3:.2f} ms/token "
          f"(MoE alone caps decode at {1e6 / (LAYERS * us1):.0f} tok/s)")
    if out_json:
        with open(out_json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), copy_bw=bw, matmul_flops=rate, rows=rows), f, indent=1)
    return rows


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-json", default=None)
    p.add_argument("--tp", type=int, default=1, help="per-rank intermediate size I = 768 / tp")
    p.add_argument("--no-ref", action="store_true", help="skip timing the torch reference")
    args = p.parse_args()
    main(args.out_json, args.tp, not args.no_ref)
