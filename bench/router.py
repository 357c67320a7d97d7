"""Microbenchmark (#26): the MoE router before and after, µs per layer at Qwen3-30B-A3B shapes
(hidden 2048, 128 experts, top-8, norm_topk_prob), bf16, on one GPU.

    old = bench/router_baseline.py (rank every expert against every other; 16 tokens a program
          for route, 8-token tiles for the fused router)
    new = engine/kernels/moe_routing.py (what the engine runs: one token a program for route,
          1-2 token tiles for the fused router; top-k by k passes of max-and-mask)

Columns, each µs per call = per MoE layer:
    route      logits [N, E] -> probs, top-k weights and ids (the kernel alone; torch = route_ref)
    router     what a MoE layer runs to route N tokens: the fused GEMV + routing launch for
               N <= 64, the router linear + route kernel above
Each timed call is one of CALLS back-to-back launches with distinct gate weights (more bytes
than L2 holds) replayed from a CUDA graph, as the decode graphs replay the 48 MoE layers.

    python bench/router.py [--tokens 1,64,128,256] [--sweep] [--out-json f.json]
"""

import argparse
import json
import os
import sys

import torch
from triton.testing import do_bench_cudagraph

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.router_baseline import route_hidden_old, route_old  # noqa: E402
from engine.kernels.moe_routing import (FUSED_MAX_TOKENS, _route_triton, route,  # noqa: E402
                                        route_counts, route_hidden, route_ref, router_tile)
from engine.layers.gemm import linear  # noqa: E402

E, K, H = 128, 8, 2048  # Qwen3-30B-A3B router: 128 experts, top-8, hidden 2048
LAYERS = 48
CALLS = 192             # distinct gate weights per timed graph: 192 x 512 KB > the H200's L2


def _us_per_call(calls) -> float:
    """Median µs of one call, the calls replayed back to back from one CUDA graph."""
    def run():
        for c in calls:
            c()
    run()  # compile and allocate outside the capture
    torch.cuda.synchronize()
    return do_bench_cudagraph(run, rep=100, return_mode="median") * 1e3 / len(calls)


def _inputs(n: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(n, H, device="cuda", generator=g).to(torch.bfloat16)
    gates = [(torch.randn(E, H, device="cuda", generator=g) / H**0.5).to(torch.bfloat16)
             for _ in range(CALLS)]
    logits = [linear(x, gt) for gt in gates]  # [N, E] bf16, as the router linear leaves them
    return x, gates, logits


def _agreement(n: int, logits: list[torch.Tensor]) -> float:
    """Fraction of tokens whose top-k ids the two kernels agree on (they may differ only where
    two experts' probabilities tie exactly with different logits)."""
    same = total = 0
    for z in logits[:8]:
        same += int((route_old(z, K, True)[2] == _route_triton(z, K, True)[2]).all(-1).sum())
        total += n
    return same / total


def measure(n: int) -> dict:
    x, gates, logits = _inputs(n, seed=n)
    r = dict(num_tokens=n)
    r["route_old_us"] = _us_per_call([lambda z=z: route_old(z, K, True) for z in logits])
    r["route_new_us"] = _us_per_call([lambda z=z: route(z, K, True) for z in logits])
    r["route_torch_us"] = _us_per_call([lambda z=z: route_ref(z, K, True) for z in logits])
    if n <= FUSED_MAX_TOKENS:
        old_counts = [route_counts("cuda") for _ in gates]  # a layer owns its semaphores
        new_counts = [route_counts("cuda") for _ in gates]
        r["router_path"] = "fused"
        r["router_old_us"] = _us_per_call([lambda g=g, c=c: route_hidden_old(x, g, K, True, c)
                                           for g, c in zip(gates, old_counts)])
        r["router_new_us"] = _us_per_call([lambda g=g, c=c: route_hidden(x, g, K, True, c)
                                           for g, c in zip(gates, new_counts)])
    else:
        r["router_path"] = "linear+route"
        r["router_old_us"] = _us_per_call([lambda g=g: route_old(linear(x, g), K, True) for g in gates])
        r["router_new_us"] = _us_per_call([lambda g=g: route(linear(x, g), K, True) for g in gates])
    r["ids_agree"] = _agreement(n, logits)
    return r


def sweep(n: int) -> list[dict]:
    """The new kernels' tile choices at one batch size: route at 1/2/4 tokens a program and
    1/2/4 warps; the fused router at (tokens, experts, warps) a program."""
    x, gates, logits = _inputs(n, seed=1000 + n)
    rows = []
    for block_t in (1, 2, 4):
        for warps in (1, 2, 4):
            us = _us_per_call([lambda z=z: _route_triton(z, K, True, block_t=block_t, num_warps=warps)
                               for z in logits])
            rows.append(dict(num_tokens=n, kernel="route", tile=f"t{block_t} w{warps}", us=us))
    if n <= FUSED_MAX_TOKENS:
        counts = [route_counts("cuda") for _ in gates]
        for block_t in (1, 2, 4, 8):
            for block_e in (2, 4, 8):
                for warps in (1, 2, 4):
                    tile = (block_t, block_e, warps)
                    us = _us_per_call([lambda g=g, c=c: route_hidden(x, g, K, True, c, tile=tile)
                                       for g, c in zip(gates, counts)])
                    rows.append(dict(num_tokens=n, kernel="fused", tile=f"t{block_t} e{block_e} w{warps}",
                                     us=us))
    return rows


def main(tokens: list[int], do_sweep: bool = False, out_json: str | None = None) -> list[dict]:
    print(f"device {torch.cuda.get_device_name()}; E={E} top-{K} H={H} bf16; µs per call = per MoE layer")
    print(f"{'N':>5} | {'route old':>9} {'new':>7} {'torch':>7} {'speedup':>7} | "
          f"{'router':>12} {'old':>7} {'new':>7} {'speedup':>7} | {'saved/step':>10} {'ids agree':>9}")
    rows = []
    for n in tokens:
        r = measure(n)
        rows.append(r)
        saved_ms = LAYERS * (r["router_old_us"] - r["router_new_us"]) / 1e3
        print(f"{n:>5} | {r['route_old_us']:9.2f} {r['route_new_us']:7.2f} {r['route_torch_us']:7.2f} "
              f"{r['route_old_us'] / r['route_new_us']:6.1f}x | {r['router_path']:>12} "
              f"{r['router_old_us']:7.2f} {r['router_new_us']:7.2f} "
              f"{r['router_old_us'] / r['router_new_us']:6.1f}x | {saved_ms:7.2f} ms {r['ids_agree']:8.1%}")
    print(f"saved/step: {LAYERS} MoE layers x (router old - new). Engine tiles: route 1 token a "
          f"program; fused router (tokens, experts, warps) = "
          + ", ".join(f"N={n}: {router_tile(n)}" for n in tokens if n <= FUSED_MAX_TOKENS))
    sweep_rows = []
    if do_sweep:
        for n in tokens:
            sr = sweep(n)
            sweep_rows += sr
            best = {kind: min((s for s in sr if s["kernel"] == kind), key=lambda s: s["us"])
                    for kind in ("route", "fused") if any(s["kernel"] == kind for s in sr)}
            print(f"sweep N={n}: " + "  ".join(f"{s['kernel']} {s['tile']} {s['us']:.2f}" for s in sr))
            print(f"  best: " + ", ".join(f"{k} {b['tile']} {b['us']:.2f} µs" for k, b in best.items()))
    if out_json:
        with open(out_json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), rows=rows, sweep=sweep_rows), f, indent=1)
    return rows


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="1,64,128,256", help="comma list of batch sizes")
    p.add_argument("--sweep", action="store_true", help="also time the new kernels' tile choices")
    p.add_argument("--out-json", default=None)
    a = p.parse_args()
    main([int(t) for t in a.tokens.split(",")], a.sweep, a.out_json)
