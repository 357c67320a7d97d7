"""Tune the MoE expert kernels on this GPU and write the config tables the engine loads.

For Qwen3-30B-A3B shapes (E=128, top-8, H=2048, bf16) at TP=1 (I=768) and TP=2 (I=384 per rank)
and each token count M, it times every stage of both paths (moe_configs.py) over a list of
launch configs, best guesses first, until the time budget is spent:

    gemv:    w13 + SiLU (per pair)           -> w2 x weight, summed over k (per token)
    grouped: moe_align (per block_m) -> w13 + SiLU -> w2 x weight -> sum over k

Each config's output is checked against the torch reference (fp32) before it is timed; one that
fails to compile, runs out of resources or is wrong is reported and skipped. The stages are
tuned apart (their sum picks the path and block_m), then the chosen config is checked and timed
end to end. Timings are µs per call inside a CUDA graph of 8 calls that cycle through 2 copies of
the weights and 4 routings, so no call finds its experts still in L2 from the one before.
The floor is the active experts' bytes (plus x and out) over the measured copy bandwidth, or the
FLOPs over the measured bf16 matmul rate where that is larger. The "router" column is the layer's
routing at that M (router GEMV + softmax + top-k: one launch up to 64 tokens), for reference.

    python bench/tune_moe.py --budget-s 240 --out-dir $OUT/moe_configs   # H200: ~4 min
    python bench/tune_moe.py --smoke --out-dir /tmp/moe_configs           # CPU interpreter, tiny

The integrator copies the JSON files into engine/kernels/configs/.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

if not torch.cuda.is_available():  # before triton is imported: CPU runs use the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import graph_us  # noqa: E402
from engine.kernels.fused_moe import (grouped_w13_silu, grouped_w2_weighted, moe_sum,  # noqa: E402
                                      w13_silu_ref, w2_weighted_ref)
from engine.kernels.moe_align import moe_align  # noqa: E402
from engine.kernels.moe_configs import (KernelTile, MoEGemvConfig, MoEKernelConfig,  # noqa: E402
                                        config_file_name, config_to_dict, default_gemv,
                                        default_grouped, write_table)
from engine.kernels.moe_gemv import gemv_w13_silu, gemv_w2_sum  # noqa: E402
from engine.kernels.moe_routing import FUSED_MAX_TOKENS, route, route_counts, route_hidden  # noqa: E402
from engine.layers.gemm import linear  # noqa: E402
from engine.layers.moe import fused_experts  # noqa: E402

E, TOP_K, H, I_FULL = 128, 8, 2048, 768  # Qwen3-30B-A3B
MS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096]
GEMV_MAX_M = 64
BLOCK_MS = (16, 32, 64, 128)
NUM_WEIGHTS, NUM_ROUTINGS, CALLS, REPLAYS = 2, 4, 8, 5
TOL = 2e-2  # relative error vs fp32; bf16 rounding of inter and out gives ~4e-3

T = KernelTile
# Candidates in priority order (the first of each list is the untuned default). GEMV tiles keep
# every warp along K (BLOCK_K >= 256 bf16 per warp: one 16-byte vector per lane) and the fp32
# accumulators at <= 128 registers per thread.
GEMV_W13 = [T(2, 512, 2), T(4, 512, 2), T(1, 1024, 4), T(2, 1024, 4), T(4, 256, 1), T(2, 256, 1),
            T(8, 256, 1), T(1, 512, 2), T(4, 1024, 4), T(1, 2048, 8), T(2, 2048, 8), T(8, 512, 2),
            T(1, 256, 1), T(2, 512, 2, 1), T(2, 512, 4)]
GEMV_W2 = [T(2, 256, 1), T(1, 256, 1), T(4, 256, 1), T(1, 512, 2), T(2, 512, 2), T(1, 1024, 4),
           T(2, 128, 1), T(4, 128, 1), T(8, 256, 2), T(2, 1024, 4), T(8, 128, 1), T(4, 512, 2),
           T(1, 128, 1), T(2, 256, 2), T(4, 256, 2)]
GROUPED_W13 = [
    (16, T(64, 128, 4, 4)), (64, T(128, 64, 4, 4, 8)), (128, T(128, 64, 8, 4, 8)),
    (32, T(64, 128, 4, 3, 8)), (16, T(32, 256, 4, 3)), (128, T(128, 128, 8, 3, 8)),
    (64, T(128, 64, 8, 3, 8)), (16, T(64, 64, 4, 4)), (128, T(256, 64, 8, 3, 8)),
    (32, T(128, 64, 4, 4, 8)), (64, T(64, 128, 4, 3, 8)), (128, T(64, 64, 4, 4, 8)),
    (16, T(16, 256, 4, 3)), (64, T(128, 128, 8, 3, 8)), (128, T(128, 64, 4, 4, 8)),
]
GROUPED_W2 = [
    (16, T(32, 128, 4, 4)), (64, T(128, 128, 8, 3, 8)), (128, T(128, 128, 8, 3, 8)),
    (32, T(128, 128, 4, 3, 8)), (16, T(64, 256, 4, 3)), (128, T(256, 64, 8, 3, 8)),
    (64, T(256, 64, 8, 3, 8)), (16, T(128, 128, 4, 3)), (128, T(128, 64, 8, 4, 8)),
    (32, T(64, 64, 4, 4, 8)), (64, T(64, 64, 4, 4, 8)), (128, T(64, 128, 4, 3, 8)),
    (16, T(64, 64, 4, 4)), (64, T(128, 64, 4, 4, 8)), (128, T(256, 128, 8, 3, 8)),
]
SMOKE = dict(E=8, top_k=2, H=64, I=32, ms=[1, 3, 8], gemv_max_m=4, block_ms=(16, 32),
             gemv_w13=[T(8, 32, 1), T(16, 64, 2)], gemv_w2=[T(16, 32, 1), T(32, 16, 1)],
             grouped_w13=[(16, T(16, 32, 4, 2)), (32, T(32, 32, 4, 2, 2))],
             grouped_w2=[(16, T(32, 16, 4, 2)), (32, T(16, 32, 4, 2, 2))])


class ContextLost(RuntimeError):
    """The CUDA context is unusable (e.g. an illegal address): nothing after it can be trusted."""


# ---------------------------------------------------------------- timing

def wall_us(calls) -> float:
    """CPU (interpreter): wall time of the first call; proves the path runs, says nothing of speed."""
    t0 = time.perf_counter()
    calls[0]()
    return (time.perf_counter() - t0) * 1e6


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want).norm() / want.norm().clamp_min(1e-30)).item()


def context_ok() -> bool:
    if not torch.cuda.is_available():
        return True
    try:
        torch.cuda.synchronize()
        return True
    except RuntimeError:
        return False


# ---------------------------------------------------------------- problem set-up

@dataclass
class Case:
    """One token count M of one shape: NUM_ROUTINGS inputs, stage references for routing 0."""
    m: int
    xs: list
    ws: list
    ids: list
    inter_ref: torch.Tensor   # [M*k, I] fp32
    inter_in: torch.Tensor    # [M*k, I] the reference rounded to the dtype: the w2 stages' input
    y_ref: torch.Tensor       # [M*k, H] fp32, weighted per pair, from inter_in
    out2_ref: torch.Tensor    # [M, H] fp32, y_ref summed over k
    out_ref: torch.Tensor     # [M, H] fp32 end to end
    experts: float            # mean active experts per call
    floor_us: float
    floor_bw_us: float
    floor_mm_us: float
    aligned: dict = field(default_factory=dict)

    def align(self, bm: int, num_experts: int) -> list:
        if bm not in self.aligned:
            self.aligned[bm] = [moe_align(ids, num_experts, bm) for ids in self.ids]
        return self.aligned[bm]


@dataclass
class Shape:
    tp: int
    num_experts: int
    top_k: int
    hidden: int
    inter: int
    dtype: torch.dtype
    w13s: list
    w2s: list
    cases: dict
    best: dict = field(default_factory=dict)    # (stage, M, block_m | None) -> (µs, candidate)
    failed: set = field(default_factory=set)     # (stage, candidate) that cannot run here

    @property
    def label(self) -> str:
        return f"TP={self.tp} (I={self.inter})"


def build_shape(tp: int, p: dict, ms: list[int], dev, dtype, bw: float, mm_rate: float) -> Shape:
    e, k, h, i = p["E"], p["top_k"], p["H"], p["I"] // tp
    g = torch.Generator(device=dev).manual_seed(tp)
    w13s = [(torch.randn(e, 2 * i, h, device=dev, generator=g) / h**0.5).to(dtype) for _ in range(NUM_WEIGHTS)]
    w2s = [(torch.randn(e, h, i, device=dev, generator=g) / i**0.5).to(dtype) for _ in range(NUM_WEIGHTS)]
    expert_bytes = 3 * h * i * w13s[0].element_size()
    cases = {}
    for m in ms:
        xs, ws, idss = [], [], []
        for _ in range(NUM_ROUTINGS):
            xs.append(torch.randn(m, h, device=dev, generator=g).to(dtype))
            _, w, ids = route(torch.randn(m, e, device=dev, generator=g).to(dtype), k, True)
            ws.append(w)
            idss.append(ids)
        experts = statistics.mean(torch.unique(ids).numel() for ids in idss)
        inter_ref = w13_silu_ref(xs[0], w13s[0], idss[0])
        inter_in = inter_ref.to(dtype)
        y_ref = w2_weighted_ref(inter_in, w2s[0], ws[0], idss[0])
        out_ref = w2_weighted_ref(inter_ref, w2s[0], ws[0].to(dtype).float(), idss[0]).view(m, k, h).sum(1)
        bytes_ = experts * expert_bytes + 2 * m * h * xs[0].element_size()
        floor_bw = bytes_ / bw * 1e6
        floor_mm = 2 * m * k * 3 * h * i / mm_rate * 1e6
        cases[m] = Case(m, xs, ws, idss, inter_ref, inter_in, y_ref, y_ref.view(m, k, h).sum(1), out_ref,
                        experts, max(floor_bw, floor_mm), floor_bw, floor_mm)
    return Shape(tp, e, k, h, i, dtype, w13s, w2s, cases)


# ---------------------------------------------------------------- stages

STAGES = ("gemv_w13", "gemv_w2", "grouped_w13", "grouped_w2")


def stage_calls(stage: str, sh: Shape, c: Case, cand):
    """The CALLS calls of one stage (call i: weights i % 2, routing i % 4), and (output of call 0, ref)."""
    out = torch.empty(c.m, sh.hidden, dtype=sh.dtype, device=c.xs[0].device)
    calls = []
    for n in range(CALLS):
        w13, w2 = sh.w13s[n % NUM_WEIGHTS], sh.w2s[n % NUM_WEIGHTS]
        r = n % NUM_ROUTINGS
        x, w, ids = c.xs[r], c.ws[r], c.ids[r]
        if stage == "gemv_w13":
            calls.append(lambda x=x, w13=w13, ids=ids: gemv_w13_silu(x, w13, ids, cand))
        elif stage == "gemv_w2":
            calls.append(lambda w2=w2, w=w, ids=ids: gemv_w2_sum(c.inter_in, w2, w, ids, cand, out))
        else:
            bm, tile = cand
            al = c.align(bm, sh.num_experts)[r]
            if stage == "grouped_w13":
                calls.append(lambda x=x, w13=w13, al=al: grouped_w13_silu(
                    x, w13, al, c.m * sh.top_k, sh.top_k, bm, tile))
            else:
                calls.append(lambda w2=w2, w=w, al=al: grouped_w2_weighted(c.inter_in, w2, w, al, bm, tile))
    ref = {"gemv_w13": c.inter_ref, "grouped_w13": c.inter_ref, "gemv_w2": c.out2_ref,
           "grouped_w2": c.y_ref}[stage]
    return calls, ref


def applies(stage: str, cand, m: int, sh: Shape, gemv_max_m: int) -> bool:
    if stage.startswith("gemv"):
        return m <= gemv_max_m
    bm = cand[0]  # a block_m much larger than the pairs per expert only pads
    per_expert = math.ceil(m * sh.top_k / sh.num_experts)
    return bm <= max(16, 2 * triton_next_pow2(per_expert))


def triton_next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def cand_short(cand) -> str:
    return cand.short() if isinstance(cand, KernelTile) else f"bm{cand[0]} {cand[1].short()}"


def evaluate(stage: str, cand, sh: Shape, ms: list[int], timer, gemv_max_m: int) -> str:
    """Check, then time one candidate of one stage at every M it applies to; keep the best."""
    if (stage, cand) in sh.failed:
        return ""
    parts = []
    for m in ms:
        if not applies(stage, cand, m, sh, gemv_max_m):
            continue
        c = sh.cases[m]
        try:
            calls, ref = stage_calls(stage, sh, c, cand)
            err = rel_err(calls[0](), ref)
            if not err < TOL:
                parts.append(f"{m}:WRONG({err:.1e})")
                continue
            us = timer(calls)
        except Exception as exc:  # compile error, out of resources, ...: skip this candidate here
            if not context_ok():
                raise ContextLost(f"{stage} {cand_short(cand)} at M={m}: {exc}") from exc
            sh.failed.add((stage, cand))
            parts.append(f"failed {type(exc).__name__}: {str(exc).splitlines()[0][:80] if str(exc) else ''}")
            break
        key = (stage, m, cand[0] if stage.startswith("grouped") else None)
        if key not in sh.best or us < sh.best[key][0]:
            sh.best[key] = (us, cand)
        parts.append(f"{m}:{us:.1f}")
    return " ".join(parts)


def aux_times(sh: Shape, ms: list[int], block_ms, timer) -> None:
    """moe_align per plausible block_m and the final sum over k: the grouped path's fixed costs."""
    for m in ms:
        c = sh.cases[m]
        for bm in block_ms:
            if not applies("grouped", (bm, None), m, sh, 0) or ("align", m, bm) in sh.best:
                continue
            ids = [c.ids[n % NUM_ROUTINGS] for n in range(CALLS)]
            sh.best[("align", m, bm)] = (timer([lambda i=i: moe_align(i, sh.num_experts, bm) for i in ids]), None)
        y = torch.empty(m * sh.top_k, sh.hidden, dtype=sh.dtype, device=c.xs[0].device).normal_()
        out = torch.empty(m, sh.hidden, dtype=sh.dtype, device=y.device)
        sh.best[("sum", m, None)] = (timer([lambda: moe_sum(y, out, sh.top_k)] * CALLS), None)


# ---------------------------------------------------------------- choosing

def options(sh: Shape, m: int, block_ms) -> list[tuple[float, object]]:
    """(sum of stage µs, config) for every path / block_m whose stages all have a timing."""
    b = sh.best
    opts = []
    if ("gemv_w13", m, None) in b and ("gemv_w2", m, None) in b:
        opts.append((b[("gemv_w13", m, None)][0] + b[("gemv_w2", m, None)][0],
                     MoEGemvConfig(b[("gemv_w13", m, None)][1], b[("gemv_w2", m, None)][1])))
    for bm in block_ms:
        keys = [("align", m, bm), ("grouped_w13", m, bm), ("grouped_w2", m, bm), ("sum", m, None)]
        if all(k in b for k in keys):
            opts.append((sum(b[k][0] for k in keys),
                         MoEKernelConfig(bm, b[keys[1]][1][1], b[keys[2]][1][1])))
    return sorted(opts, key=lambda o: o[0])


def end_to_end(sh: Shape, c: Case, cfg, timer) -> tuple[float, float]:
    """(µs per call of the whole expert computation, relative error vs the fp32 reference)."""
    calls = []
    for n in range(CALLS):
        w13, w2 = sh.w13s[n % NUM_WEIGHTS], sh.w2s[n % NUM_WEIGHTS]
        r = n % NUM_ROUTINGS
        calls.append(lambda w13=w13, w2=w2, r=r: fused_experts(c.xs[r], w13, w2, c.ws[r], c.ids[r], config=cfg))
    err = rel_err(calls[0](), c.out_ref)
    return (timer(calls) if err < TOL else float("nan")), err


def choose(sh: Shape, ms: list[int], block_ms, timer, final: bool) -> dict[int, dict]:
    """M -> table entry. final: check and time the best of each path end to end (else stage sums)."""
    table = {}
    for m in ms:
        c = sh.cases[m]
        opts = options(sh, m, block_ms)
        per_path = {}
        for est, cfg in opts:  # best first
            if cfg.path in per_path:
                continue
            if not final:
                per_path[cfg.path] = (est, cfg, None)
                continue
            try:
                us, err = end_to_end(sh, c, cfg, timer)
            except Exception as exc:
                if not context_ok():
                    raise ContextLost(f"end to end {cfg.short()} at M={m}: {exc}") from exc
                print(f"  {sh.label} M={m}: {cfg.short()} failed end to end: {type(exc).__name__}", flush=True)
                continue
            if us == us:  # not nan: correct
                per_path[cfg.path] = (us, cfg, err)
            else:
                print(f"  {sh.label} M={m}: {cfg.short()} WRONG end to end (rel err {err:.1e})", flush=True)
        if not per_path:
            continue
        us, cfg, err = min(per_path.values(), key=lambda v: v[0])
        entry = config_to_dict(cfg)
        entry.update(us=round(us, 2), floor_us=round(c.floor_us, 2), pct_of_floor=round(100 * c.floor_us / us, 1),
                     experts=c.experts, verified=final,
                     **{f"{p}_us": round(v[0], 2) for p, v in per_path.items()})
        if err is not None:
            entry["rel_err"] = float(f"{err:.2e}")
        table[m] = entry
    return table


def write_tables(shapes: list[Shape], tables: dict[int, dict], out_dir: Path, device: str, meta: dict) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for sh in shapes:
        if not tables.get(sh.tp):
            continue
        name = config_file_name(sh.num_experts, sh.inter, sh.hidden, sh.dtype, device)
        write_table(out_dir / name, tables[sh.tp], E=sh.num_experts, N=sh.inter, H=sh.hidden, top_k=sh.top_k,
                    dtype=str(sh.dtype).replace("torch.", ""), device=device, tp=sh.tp, **meta)
        paths.append(out_dir / name)
    return paths


def print_table(sh: Shape, table: dict[int, dict], route_us: dict) -> None:
    print(f"\n{sh.label}: E={sh.num_experts} top-{sh.top_k} H={sh.hidden}; µs per call in a CUDA graph; "
          f"floor = max(active bytes / copy rate, FLOPs / matmul rate)")
    print(f"{'M':>5} {'experts':>7} {'floor bw':>8} {'floor mm':>8} | {'gemv':>8} {'grouped':>8} | "
          f"{'chosen':>8} {'% floor':>7} {'router':>6} | config")
    for m, e in sorted(table.items()):
        c = sh.cases[m]
        g = f"{e['gemv_us']:8.1f}" if "gemv_us" in e else f"{'-':>8}"
        gr = f"{e['grouped_us']:8.1f}" if "grouped_us" in e else f"{'-':>8}"
        r = route_us.get(m)
        print(f"{m:>5} {c.experts:7.1f} {c.floor_bw_us:8.1f} {c.floor_mm_us:8.1f} | {g} {gr} | "
              f"{e['us']:8.1f} {e['pct_of_floor']:6.0f}% {'' if r is None else f'{r:6.1f}'} | "
              f"{e['path']}" + (f" bm{e['block_m']}" if "block_m" in e else "")
              + f" w13[{KernelTile(**e['w13']).short()}] w2[{KernelTile(**e['w2']).short()}]")


# ---------------------------------------------------------------- main

def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget-s", type=float, default=240.0, help="wall-clock budget for the whole run")
    p.add_argument("--out-dir", default=os.path.join(os.environ.get("OUT", "."), "moe_configs"))
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    p.add_argument("--m", type=int, nargs="+", default=None, help=f"token counts (default {MS})")
    p.add_argument("--gemv-max-m", type=int, default=None, help=f"largest M tried on the GEMV path ({GEMV_MAX_M})")
    p.add_argument("--json", default=None, help="also dump every stage timing here")
    p.add_argument("--smoke", action="store_true", help="tiny shapes and configs (CPU interpreter ok)")
    a = p.parse_args(argv)
    t_start = time.perf_counter()
    cuda = torch.cuda.is_available() and not a.smoke
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if a.smoke:
        shape = dict(E=SMOKE["E"], top_k=SMOKE["top_k"], H=SMOKE["H"], I=SMOKE["I"])
        ms, gemv_max_m, block_ms = a.m or SMOKE["ms"], a.gemv_max_m or SMOKE["gemv_max_m"], SMOKE["block_ms"]
        queues = {s: list(SMOKE[s]) for s in STAGES}
        dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16
    else:
        if not torch.cuda.is_available():
            sys.exit("needs a CUDA GPU (use --smoke on a CPU)")
        shape = dict(E=E, top_k=TOP_K, H=H, I=I_FULL)
        ms, gemv_max_m, block_ms = a.m or MS, a.gemv_max_m or GEMV_MAX_M, BLOCK_MS
        queues = {"gemv_w13": list(GEMV_W13), "gemv_w2": list(GEMV_W2),
                  "grouped_w13": list(GROUPED_W13), "grouped_w2": list(GROUPED_W2)}
        dtype = torch.bfloat16
    # every block_m's default tiles go first, so each M has a grouped option early
    defaults = {}
    for m in (2 ** n for n in range(20)):
        d = default_grouped(m, shape["top_k"], shape["E"])
        defaults.setdefault(d.block_m, d)
    for bm in reversed(block_ms):
        if bm not in defaults:
            continue
        for stage, tile in (("grouped_w13", defaults[bm].w13), ("grouped_w2", defaults[bm].w2)):
            if (bm, tile) in queues[stage]:
                queues[stage].remove((bm, tile))
            queues[stage].insert(0, (bm, tile))
    if not a.smoke:
        dg = default_gemv(2)
        for stage, tile in (("gemv_w13", dg.w13), ("gemv_w2", dg.w2)):
            if tile in queues[stage]:
                queues[stage].remove(tile)
            queues[stage].insert(0, tile)

    timer = (lambda calls: graph_us(calls, REPLAYS)) if cuda else wall_us
    if cuda:
        from bench.common import measure_copy_bandwidth, measure_matmul_flops
        bw, mm_rate = measure_copy_bandwidth(dev), measure_matmul_flops(dev)
        device = torch.cuda.get_device_name()
    else:
        bw, mm_rate, device = 1e11, 1e12, "cpu"
    print(f"device {device}: copy {bw / 1e12:.2f} TB/s, matmul {mm_rate / 1e12:.0f} TFLOP/s; "
          f"budget {a.budget_s:.0f} s; M {ms}; GEMV path tried up to M={gemv_max_m}", flush=True)
    shapes = [build_shape(tp, shape, ms, dev, dtype, bw, mm_rate) for tp in a.tp]
    route_us = {}  # the layer's router at M: gate GEMV + routing fused up to FUSED_MAX_TOKENS, else two launches
    if cuda:
        counts = route_counts(dev)
        gates = [(torch.randn(shape["E"], shape["H"], device=dev) / shape["H"] ** 0.5).to(dtype)
                 for _ in range(NUM_WEIGHTS)]
        for m in ms:
            x = torch.randn(m, shape["H"], device=dev).to(dtype)
            if m <= FUSED_MAX_TOKENS:
                calls = [lambda g=g: route_hidden(x, g, shape["top_k"], True, counts) for g in gates]
            else:
                calls = [lambda g=g: route(linear(x, g), shape["top_k"], True) for g in gates]
            route_us[m] = timer(calls * (CALLS // NUM_WEIGHTS))
    print(f"set-up done at {time.perf_counter() - t_start:.0f} s", flush=True)

    meta = dict(tuned_by="python bench/tune_moe.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                date=time.strftime("%Y-%m-%d %H:%M"), copy_tb_s=round(bw / 1e12, 3),
                matmul_tflop_s=round(mm_rate / 1e12, 1), torch=torch.__version__)
    try:
        import triton
        meta["triton"] = triton.__version__
    except ImportError:
        pass
    out_dir = Path(a.out_dir)
    reserve = max(15.0, 0.12 * a.budget_s) if cuda else 0.0  # the end-to-end checks and timings
    lost = None
    try:
        for sh in shapes:
            aux_times(sh, ms, block_ms, timer)
        rnd = 0
        while any(queues.values()):
            for stage in STAGES:
                if not queues[stage]:
                    continue
                cand = queues[stage].pop(0)
                for sh in shapes:
                    if time.perf_counter() - t_start > a.budget_s - reserve:
                        raise TimeoutError
                    t0 = time.perf_counter()
                    res = evaluate(stage, cand, sh, ms, timer, gemv_max_m)
                    print(f"[{time.perf_counter() - t_start:5.0f}s] {stage:<11} {cand_short(cand):<26} "
                          f"TP={sh.tp} ({time.perf_counter() - t0:.1f}s) {res}", flush=True)
            rnd += 1
            if rnd % 2 == 0:  # a usable file early, in case the run is cut short
                write_tables(shapes, {sh.tp: choose(sh, ms, block_ms, timer, False) for sh in shapes},
                             out_dir, device, meta)
    except TimeoutError:
        print(f"budget reached at {time.perf_counter() - t_start:.0f} s; untried: "
              + ", ".join(f"{s} {len(q)}" for s, q in queues.items()), flush=True)
    except ContextLost as exc:
        lost = str(exc)
        print(f"CUDA context lost ({exc}); writing the stage-sum choices made so far", flush=True)
    tables = {sh.tp: choose(sh, ms, block_ms, timer, final=lost is None) for sh in shapes}
    paths = write_tables(shapes, tables, out_dir, device, meta)
    for sh in shapes:
        print_table(sh, tables[sh.tp], route_us)
    print(f"\nwrote {', '.join(str(p) for p in paths)} in {time.perf_counter() - t_start:.0f} s", flush=True)
    result = dict(device=device, copy_bw=bw, matmul_flops=mm_rate, tables={str(k): v for k, v in tables.items()},
                  stages={f"TP={sh.tp} {k[0]} M={k[1]} bm={k[2]}": [v[0], None if v[1] is None else cand_short(v[1])]
                          for sh in shapes for k, v in sh.best.items()})
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
