"""Where a Qwen3-30B-A3B batch-1 decode step's GPU time goes (bench/diagnostics/decode_chain.py for MoE).

    python bench/diagnostics/moe_chain.py [--context 256] [--replays 20]
    TRITON_INTERPRET=1 python bench/diagnostics/moe_chain.py --smoke   # CPU, tiny shapes: does it still run

The engine's batch-1 MoE decode step, rebuilt from its own kernels at Qwen3-30B-A3B shapes (48
layers, random bf16 weights generated on the GPU — ~58 GB of experts — and a paged KV cache of
the engine's block-table width) and captured in one CUDA graph, PDL-chained as the engine runs
it. It times the whole chain, the chain with one kind of kernel left out (its marginal cost:
what the step would gain if that kernel were free) and each kind alone, then variants: the
post-attention norm as its own launch (the path before the fold), other router tiles,
attention split counts. The 400 tok/s target (#26) is 2.5 ms a step.

A diagnostic: it prints tables and changes nothing; left-out kernels' consumers read stale
buffers, and the outputs are not checked (the kernels' tests do that).
"""
from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

from bench.diagnostics.decode_chain import chain_cli, one_sequence
from engine.kernels import decode_attention as DA
from engine.kernels import moe_routing as MR
from engine.kernels import skinny_gemm as SG
from engine.kernels.qk_norm_rope_store import qk_norm_rope_store
from engine.kernels.rmsnorm import fused_add_rms_norm, rms_norm
from engine.layers.moe import fused_experts

# Qwen3-30B-A3B
LAYERS, HIDDEN, HQ, HKV, D, EXPERTS, TOP_K, MOE_INTER, VOCAB = 48, 2048, 32, 4, 128, 128, 8, 768, 151936
PAGE, TABLE_WIDTH = 16, 256  # max_model_len 4096 / 16-token blocks: the engine's graph width
KINDS = ("qkv", "rope", "attn", "o", "router", "experts", "head")
SMOKE_SHAPES = dict(LAYERS=1, HIDDEN=64, HQ=4, HKV=1, D=32, EXPERTS=8, TOP_K=2, MOE_INTER=32,
                    VOCAB=64, TABLE_WIDTH=4)


class MoEChain:
    def __init__(self, context: int, dev: str = "cuda", dtype=torch.bfloat16, seed: int = 0):
        g = torch.Generator(device=dev).manual_seed(seed)
        self.context = context

        def rnd(*shape, scale=0.02):
            return (torch.randn(*shape, generator=g, device=dev) * scale).to(dtype)

        num_blocks = 4 * TABLE_WIDTH
        self.layers = [dict(
            in_norm=1 + rnd(HIDDEN, scale=0.1), post_norm=1 + rnd(HIDDEN, scale=0.1),
            qkv=rnd((HQ + 2 * HKV) * D, HIDDEN), o=rnd(HIDDEN, HQ * D),
            gate=rnd(EXPERTS, HIDDEN), counts=MR.route_counts(dev),
            w13=rnd(EXPERTS, 2 * MOE_INTER, HIDDEN), w2=rnd(EXPERTS, HIDDEN, MOE_INTER),
            q_norm=1 + rnd(D, scale=0.1), k_norm=1 + rnd(D, scale=0.1),
            k_cache=rnd(num_blocks, PAGE, HKV, D, scale=1.0),
            v_cache=rnd(num_blocks, PAGE, HKV, D, scale=1.0)) for _ in range(LAYERS)]
        self.final_norm = 1 + rnd(HIDDEN, scale=0.1)
        self.head = rnd(VOCAB, HIDDEN)
        self.x = rnd(1, HIDDEN, scale=1.0)
        self.residual = rnd(1, HIDDEN, scale=1.0)
        cpu = torch.Generator().manual_seed(seed)
        (self.cos_sin, self.block_table, self.context_lens, self.positions,
         self.slots) = one_sequence(context, D, num_blocks, TABLE_WIDTH, PAGE, dev, cpu)
        # stand-ins a left-out kernel's consumer reads instead
        self.qkv_buf = rnd(1, (HQ + 2 * HKV) * D, scale=1.0)
        self.q_buf = rnd(1, HQ, D, scale=1.0)
        self.attn_buf = rnd(1, HQ, D, scale=1.0)
        self.h_buf = rnd(1, HIDDEN, scale=1.0)
        self.ids_buf = torch.randperm(EXPERTS, generator=cpu)[:TOP_K].view(1, -1).to(dev, torch.int32)
        self.w_buf = torch.full((1, TOP_K), 1.0 / TOP_K, device=dev)
        self.fold_norm = True           # the post-attention norm inside the router (the engine)
        self.router_tile = None         # None: moe_routing.router_tile's choice
        self.num_splits: int | None = None
        self.o_config = SG.whole_tile_config(HIDDEN, HQ * D)
        self.qkv_config = None          # None: the engine's pick (pick_config, wide)

    def step(self, skip: frozenset = frozenset(), only: str | None = None) -> None:
        run = (lambda k: k == only) if only else (lambda k: k not in skip)
        x, res = self.x, self.residual
        for L in self.layers:
            qkv = self.qkv_buf
            if run("qkv"):
                qkv, res = SG.rms_norm_linear(x, L["qkv"], L["in_norm"], 1e-6, res, factored=True,
                                               config=self.qkv_config)
            q = self.q_buf
            if run("rope"):
                q = qk_norm_rope_store(qkv, self.positions, self.cos_sin, L["k_cache"], L["v_cache"],
                                       self.slots, HQ, HKV, L["q_norm"], L["k_norm"], 1e-6)
            a = self.attn_buf
            if run("attn"):
                a = DA.paged_decode_attention(q, L["k_cache"], L["v_cache"], self.block_table,
                                              self.context_lens, D ** -0.5, num_splits=self.num_splits)
            h = self.h_buf
            if run("o"):
                h = SG.skinny_linear(a.view(1, HQ * D), L["o"], config=self.o_config)
            xn, w, ids = h, self.w_buf, self.ids_buf
            if run("router"):
                if self.fold_norm:
                    _, w, ids, xn, res = MR.norm_route_hidden(h, res, L["post_norm"], 1e-6, L["gate"],
                                                              TOP_K, True, L["counts"],
                                                              tile=self.router_tile)
                else:
                    xn, res = fused_add_rms_norm(h, res, L["post_norm"], 1e-6)
                    _, w, ids = MR.route_hidden(xn, L["gate"], TOP_K, True, L["counts"],
                                                tile=self.router_tile)
            x = self.h_buf
            if run("experts"):
                x = fused_experts(xn, L["w13"], L["w2"], w, ids)
        if run("head"):
            hn = rms_norm(x, self.final_norm, 1e-6)
            torch.argmax(SG.skinny_linear(hn, self.head), dim=-1)


def main(argv=None) -> None:
    chain_cli(argv, __doc__.split("\n")[0], globals(), SMOKE_SHAPES, MoEChain, _run)


def _run(a, c: MoEChain, timer, smoke: bool) -> None:
    base = timer(c.step, a.replays)
    print(f"# MoE decode chain, Qwen3-30B-A3B shapes, batch 1, context {c.context}, PDL "
          f"{'on' if SG.use_pdl(c.x) else 'off'}" + (" (--smoke: tiny shapes, CPU)" if smoke else ""))
    print(f"whole chain: {base:.1f} us/step  ({1e6 / base:,.0f} steps/s; 400 tok/s is 2,500 us)")
    print("\n| kind | left out: step us | marginal us (per layer) | alone us (per call) |")
    print("| --- | --- | --- | --- |")
    for k in (("router",) if smoke else KINDS):
        t = timer(lambda: c.step(skip=frozenset([k])), a.replays)
        alone = timer(lambda: c.step(only=k), a.replays)
        per = 1 if k == "head" else LAYERS
        print(f"| {k} | {t:.1f} | {base - t:.1f} ({(base - t) / per:.2f}) | {alone:.1f} ({alone / per:.2f}) |")

    print("\n| variant | step us | vs engine's |")
    print("| --- | --- | --- |")
    c.fold_norm = False
    t = timer(c.step, a.replays)
    print(f"| post-attention norm as its own launch (no fold) | {t:.1f} | {t - base:+.1f} |")
    c.fold_norm = True
    engine_tile = MR.router_tile(1)
    for tile in (((1, 4, 1),) if smoke else ((1, 1, 1), (1, 4, 1), (1, 2, 2), (1, 8, 2))):
        c.router_tile = tile
        t = timer(c.step, a.replays)
        print(f"| router tile (tokens, experts, warps) {tile} (engine: {engine_tile}) | {t:.1f} | "
              f"{t - base:+.1f} |")
    c.router_tile = None
    engine_splits = DA.choose_num_splits(1, HKV, TABLE_WIDTH * PAGE, c.x.device)
    for s in ((2,) if smoke else (4, 8, 16, 32)):
        c.num_splits = s
        t = timer(c.step, a.replays)
        print(f"| attention {s} splits (engine, unbounded graph: {engine_splits}) | {t:.1f} | {t - base:+.1f} |")
    c.num_splits = None
    # the dense GEMVs' tiles: (rows, K chunk, split-K, warps, stages), one-row FMA programs
    C = SG.SkinnyConfig
    qkv_n = (HQ + 2 * HKV) * D
    engine_qkv = SG.pick_config(1, qkv_n, HIDDEN, wide=True)
    qkv_tiles = ((C(4, 256, 1, 1, 3),) if smoke else
                 (C(4, 512, 1, 2, 3), C(4, 1024, 1, 4, 3), C(8, 2048, 1, 8, 3), C(4, 2048, 1, 8, 3),
                  C(2, 1024, 1, 4, 3), C(8, 1024, 1, 4, 4), C(16, 1024, 1, 8, 3), C(2, 2048, 1, 4, 1),
                  C(4, 2048, 1, 4, 1)))
    for cfg in qkv_tiles:
        c.qkv_config = cfg
        t = timer(c.step, a.replays)
        print(f"| QKV GEMV tile {cfg.short()} (engine: {engine_qkv.short()}) | {t:.1f} | {t - base:+.1f} |")
    c.qkv_config = None
    engine_o = c.o_config
    o_tiles = ((C(2, 128, 1, 1, 1),) if smoke else
               (C(2, 1024, 1, 4, 3), C(4, 4096, 1, 8, 1), C(1, 4096, 1, 4, 1), C(4, 1024, 1, 4, 3),
                C(2, 4096, 1, 8, 1), C(2, 2048, 2, 4, 1)))
    for cfg in o_tiles:
        c.o_config = cfg
        t = timer(c.step, a.replays)
        print(f"| o_proj GEMV tile {cfg.short()} (engine: {engine_o.short() if engine_o else 'pick'}) | "
              f"{t:.1f} | {t - base:+.1f} |")
    c.o_config = engine_o


if __name__ == "__main__":
    main()
