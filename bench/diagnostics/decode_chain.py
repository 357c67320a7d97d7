"""Where a batch-1 decode step's GPU time goes, now that its kernels overlap (PDL).

    python bench/diagnostics/decode_chain.py [--context 256] [--replays 20]
    TRITON_INTERPRET=1 python bench/diagnostics/decode_chain.py --smoke   # CPU, tiny shapes: does it still run

The engine's batch-1 decode graph is ~200 kernels in a row, each launched with programmatic
dependent launch, so a profiler's per-kernel durations overlap and no longer add up to the
step. This script rebuilds the same chain from the engine's own kernels at Qwen3-0.6B shapes
(28 layers, random bf16 weights, a paged KV cache with the engine's block-table width, so the
split counts are the engine's) and captures it in one CUDA graph, then times:

  * the whole chain (what a decode step's forward costs the GPU);
  * the chain with one kind of kernel left out (its *marginal* cost in the chain: what the
    step would gain if that kernel were free);
  * each kind of kernel alone, 28 in a row (its cost when it only overlaps itself);
  * launch variants the engine could pick (each GEMV's whole weight tile requested before the
    PDL wait, wider GEMV programs, attention split counts and split tiles, SiLU*up in gate_up's
    epilogue or not), each passed to the kernels' launchers as an argument.

A diagnostic, like attention_tune.py: it prints tables and changes nothing. The outputs are
not checked (the kernels' tests do that); left-out kernels' consumers read stale buffers.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import triton

from engine.kernels import decode_attention as DA
from engine.kernels import skinny_gemm as SG
from engine.kernels.activation import silu_and_mul
from engine.kernels.qk_norm_rope_store import qk_norm_rope_store
from engine.kernels.rmsnorm import rms_norm

# Qwen3-0.6B
LAYERS, HIDDEN, HQ, HKV, D, INTER, VOCAB = 28, 1024, 16, 8, 128, 3072, 151936
PAGE, TABLE_WIDTH = 16, 256  # max_model_len 4096 / 16-token blocks: the engine's graph width
KINDS = ("qkv", "rope", "attn", "o", "gate_up", "silu", "down", "head")


def one_sequence(context: int, head_dim: int, num_blocks: int, table_width: int, page: int,
                 dev, g: torch.Generator):
    """The one decoding sequence of a chain: (RoPE cos/sin table [4096, D], block table
    [1, table_width] of distinct random blocks, context lengths, positions, the new token's slot)."""
    pos = torch.arange(4096, dtype=torch.float32)[:, None]
    inv = 1e6 ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    ang = pos * inv[None, :]
    cos_sin = torch.cat([ang.cos(), ang.sin()], dim=1).to(dev)
    table = torch.randperm(num_blocks, generator=g)[:table_width].view(1, -1).to(dev, torch.int32)
    lens = torch.tensor([context], dtype=torch.int32, device=dev)
    positions = torch.tensor([context - 1], dtype=torch.int64, device=dev)
    blk = int(table[0, (context - 1) // page])
    slots = torch.tensor([blk * page + (context - 1) % page], dtype=torch.int64, device=dev)
    return cos_sin, table, lens, positions, slots


class Chain:
    def __init__(self, context: int, dev: str = "cuda", dtype=torch.bfloat16, seed: int = 0):
        g = torch.Generator(device="cpu").manual_seed(seed)
        self.context = context

        def rnd(*shape, scale=0.02):
            return (torch.randn(*shape, generator=g) * scale).to(dev, dtype)

        self.layers = []
        num_blocks = 4 * TABLE_WIDTH
        for _ in range(LAYERS):
            self.layers.append(dict(
                in_norm=1 + rnd(HIDDEN, scale=0.1), post_norm=1 + rnd(HIDDEN, scale=0.1),
                qkv=rnd((HQ + 2 * HKV) * D, HIDDEN), o=rnd(HIDDEN, HQ * D),
                gate_up=rnd(2 * INTER, HIDDEN), down=rnd(HIDDEN, INTER),
                q_norm=1 + rnd(D, scale=0.1), k_norm=1 + rnd(D, scale=0.1),
                k_cache=rnd(num_blocks, PAGE, HKV, D, scale=1.0),
                v_cache=rnd(num_blocks, PAGE, HKV, D, scale=1.0)))
        self.final_norm = 1 + rnd(HIDDEN, scale=0.1)
        self.head = rnd(VOCAB, HIDDEN)
        self.x = rnd(1, HIDDEN, scale=1.0)
        self.residual = rnd(1, HIDDEN, scale=1.0)
        (self.cos_sin, self.block_table, self.context_lens, self.positions,
         self.slots) = one_sequence(context, D, num_blocks, TABLE_WIDTH, PAGE, dev, g)
        # stand-ins a left-out kernel's consumer reads instead
        self.q_buf = rnd(1, HQ, D, scale=1.0)
        self.attn_buf = rnd(1, HQ, D, scale=1.0)
        self.act_buf = rnd(1, INTER, scale=1.0)
        self.qkv_buf = rnd(1, (HQ + 2 * HKV) * D, scale=1.0)
        self.gu_buf = rnd(1, 2 * INTER, scale=1.0)
        self.h_buf = rnd(1, HIDDEN, scale=1.0)
        self.configs: dict[str, SG.SkinnyConfig | None] = self.engine_configs()
        self.num_splits: int | None = None
        self.attn_launch: dict | None = None   # None: decode_attention.launch_config's
        self.swiglu = True  # SiLU * up in gate_up's epilogue, as the engine runs it

    @staticmethod
    def engine_configs() -> dict[str, SG.SkinnyConfig | None]:
        """None: the kernel's own pick_config; o_proj's whole tile as gemm.linear asks for it."""
        cfg: dict[str, SG.SkinnyConfig | None] = {k: None for k in KINDS}
        cfg["o"] = SG.whole_tile_config(HIDDEN, HQ * D)
        return cfg

    def step(self, skip: frozenset = frozenset(), only: str | None = None) -> None:
        run = (lambda k: k == only) if only else (lambda k: k not in skip)
        x, res = self.x, self.residual
        for L in self.layers:
            qkv = self.qkv_buf
            if run("qkv"):
                qkv, res = SG.rms_norm_linear(x, L["qkv"], L["in_norm"], 1e-6, res,
                                              config=self.configs["qkv"], factored=True)
            q = self.q_buf
            if run("rope"):
                q = qk_norm_rope_store(qkv, self.positions, self.cos_sin, L["k_cache"], L["v_cache"],
                                       self.slots, HQ, HKV, L["q_norm"], L["k_norm"], 1e-6)
            a = self.attn_buf
            if run("attn"):
                a = DA.paged_decode_attention(q, L["k_cache"], L["v_cache"], self.block_table,
                                              self.context_lens, D ** -0.5, num_splits=self.num_splits,
                                              launch=self.attn_launch)
            h = self.h_buf
            if run("o"):
                h = SG.skinny_linear(a.view(1, HQ * D), L["o"], config=self.configs["o"])
            gu = self.gu_buf
            act = self.act_buf
            if run("gate_up"):
                gu, res = SG.rms_norm_linear(h, L["gate_up"], L["post_norm"], 1e-6, res,
                                             config=self.configs["gate_up"], factored=True,
                                             gated=self.swiglu)
                if self.swiglu:
                    act = gu
            if run("silu") and not self.swiglu:
                act = silu_and_mul(gu)
            x = self.h_buf
            if run("down"):
                x = SG.skinny_linear(act, L["down"], config=self.configs["down"])
        if run("head"):
            hn = rms_norm(x, self.final_norm, 1e-6)
            logits = SG.skinny_linear(hn, self.head, config=self.configs["head"])
            torch.argmax(logits, dim=-1)


def time_graph(fn, replays: int) -> float:
    """µs per call of fn, captured once in a CUDA graph, best of 5 timings of `replays` replays."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        a.record()
        for _ in range(replays):
            g.replay()
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b) * 1e3 / replays)
    return best


def whole_tile(M: int, N: int, K: int) -> SG.SkinnyConfig:
    """The engine's config with BLOCK_K = all of K (rounded up to a power of two), so each
    program's whole weight tile is requested before the PDL wait."""
    c = SG.pick_config(M, N, K)
    return SG.SkinnyConfig(c.block_n, triton.next_power_of_2(K), 1, c.num_warps, 1, c.use_dot)


# --smoke: the CPU through Triton's interpreter, tiny shapes, one variant of each family, so the
# suite notices when a kernel's API moves under this script (timings there mean nothing)
SMOKE_SHAPES = dict(LAYERS=1, HIDDEN=64, HQ=2, HKV=1, D=32, INTER=64, VOCAB=64, TABLE_WIDTH=4)


def time_eager(fn, replays: int) -> float:
    import time
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e6


def chain_cli(argv, description: str, shapes: dict, smoke_shapes: dict, build, run) -> None:
    """The command line of both chain benches (this one, bench/diagnostics/moe_chain.py): on the GPU, `build`
    (context, device, dtype) then `run`(args, chain, time_graph, smoke=False); with --smoke, the
    module's shape constants (`shapes`: its globals()) swapped for `smoke_shapes` for the run and
    restored after, on the CPU in fp32 and timed eagerly."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--context", type=int, default=256, help="KV length of the one sequence")
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--smoke", action="store_true", help="CPU (interpreter), tiny shapes, few variants")
    a = p.parse_args(argv)
    if not a.smoke:
        return run(a, build(a.context, "cuda", torch.bfloat16), time_graph, False)
    saved = {k: shapes[k] for k in smoke_shapes}
    shapes.update(smoke_shapes)
    try:
        context = min(a.context, shapes["TABLE_WIDTH"] * shapes["PAGE"])
        run(a, build(context, "cpu", torch.float32), time_eager, True)
    finally:
        shapes.update(saved)


def main(argv=None) -> None:
    chain_cli(argv, __doc__.split("\n")[0], globals(), SMOKE_SHAPES, Chain, _run)


def _run(a, c: Chain, timer, smoke: bool) -> None:
    torch.manual_seed(0)
    base = timer(c.step, a.replays)
    print(f"# decode chain, Qwen3-0.6B shapes, batch 1, context {c.context}, PDL "
          f"{'on' if SG.use_pdl(c.x) else 'off'}, fused norms (factored)"
          + (" (--smoke: tiny shapes, CPU)" if smoke else ""))
    print(f"whole chain: {base:.1f} us/step  ({1e6 / base:,.0f} steps/s); SiLU*up in gate_up's "
          f"epilogue: {c.swiglu}")
    print("\n| kind | left out: step us | marginal us (per layer) | alone x28 us (per call) |")
    print("| --- | --- | --- | --- |")
    for k in (("attn",) if smoke else KINDS):
        t = timer(lambda: c.step(skip=frozenset([k])), a.replays)
        alone = timer(lambda: c.step(only=k), a.replays)
        per = 1 if k == "head" else LAYERS
        print(f"| {k} | {t:.1f} | {base - t:.1f} ({(base - t) / per:.2f}) | {alone:.1f} ({alone / per:.2f}) |")

    print("\n| variant | step us | vs engine's |")
    print("| --- | --- | --- |")
    shapes = dict(qkv=((HQ + 2 * HKV) * D, HIDDEN), o=(HIDDEN, HQ * D), gate_up=(2 * INTER, HIDDEN),
                  down=(HIDDEN, INTER), head=(VOCAB, HIDDEN))

    def tile(k, n, kk):
        cfg = whole_tile(1, n, kk)
        return SG.gated_config(cfg) if k == "gate_up" and c.swiglu else cfg

    for k, (n, kk) in shapes.items():
        if smoke and k != "o":
            continue
        c.configs[k] = tile(k, n, kk)
        t = timer(c.step, a.replays)
        print(f"| {k}: whole weight tile before the wait ({c.configs[k].short()}; engine "
              f"{SG.pick_config(1, n, kk).short()}) | {t:.1f} | {t - base:+.1f} |")
        c.configs[k] = c.engine_configs()[k]
    if not smoke:
        for k, (n, kk) in shapes.items():
            c.configs[k] = tile(k, n, kk)
        t = timer(c.step, a.replays)
        print(f"| all GEMVs whole tile | {t:.1f} | {t - base:+.1f} |")
        for k in shapes:
            c.configs[k] = c.engine_configs()[k]
    # fewer, wider programs for every GEMV (skinny_gemm.WIDE_M1; the engine takes them for QKV only)
    wide = {k: SG.SkinnyConfig(8, 1024, 1, 4, 3) if n >= 4096 else SG.SkinnyConfig(4, 1024, 1, 4, 3)
            for k, (n, kk) in shapes.items()}
    if c.swiglu:
        wide["gate_up"] = SG.gated_config(wide["gate_up"])
    for k in (("gate_up",) if smoke else shapes):
        c.configs[k] = wide[k]
        t = timer(c.step, a.replays)
        print(f"| {k}: wider programs ({wide[k].short()}) | {t:.1f} | {t - base:+.1f} |")
        c.configs[k] = c.engine_configs()[k]
    if not smoke:
        c.configs.update(wide)
        t = timer(c.step, a.replays)
        print(f"| all GEMVs wider programs | {t:.1f} | {t - base:+.1f} |")
        for k in shapes:
            c.configs[k] = c.engine_configs()[k]
    engine_splits = DA.choose_num_splits(1, HKV, TABLE_WIDTH * PAGE, c.x.device)
    for s in ((2,) if smoke else (4, 8, 16, 32)):
        c.num_splits = s
        t = timer(c.step, a.replays)
        print(f"| attention {s} splits (engine: {engine_splits}) | {t:.1f} | {t - base:+.1f} |")
    c.num_splits = None
    for bn, w in (((16, 2),) if smoke else ((16, 2), (32, 2))):
        c.attn_launch = dict(DA.SPLIT_LAUNCH, BLOCK_N=bn, num_warps=w)
        c.num_splits = 2 if smoke else None  # (the smoke shapes' engine choice is 1 split)
        t = timer(c.step, a.replays)
        print(f"| attention split tiles BLOCK_N={bn} num_warps={w} (engine: {DA.SPLIT_LAUNCH}) | "
              f"{t:.1f} | {t - base:+.1f} |")
    c.num_splits = c.attn_launch = None
    c.swiglu = not c.swiglu
    t = timer(c.step, a.replays)
    print(f"| SiLU*up in gate_up's epilogue: {c.swiglu} | {t:.1f} | {t - base:+.1f} |")
    c.swiglu = not c.swiglu


if __name__ == "__main__":
    main()
