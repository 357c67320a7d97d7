"""CUDA graphs for decode: one graph per batch-size bucket, per variant.

Probe-free graphs are captured at start-up; probe-capturing variants (probes/buffers.
graph_variant), cascade graphs (engine/cascade.py) and intervention variants (one per plan key,
interventions/buffers.py, tables refilled before each replay) are captured at first use, so
start-up stays as fast as with probes off. Small buckets also get probe-free graphs bounded to
a shorter context (decode_attention.context_caps): a graph's attention grid is fixed, and a
short context replays one with fewer splits.

Inputs are static device buffers sized for max_num_seqs rows and max_model_len plus one block,
so any batch up to the largest bucket replays (padded rows: context 0, slot -1); larger ones
run eagerly. Each step fills them by one non-blocking copy per dtype from pinned memory
allocated for that step: with overlap scheduling step N+1 is prepared before step N's copies
ran, so a reused staging buffer would race. With TP every rank captures the same graphs in the
same order and replays them in lockstep; one decode step in TIMED_EVERY replays a "timed" copy
whose collectives are bracketed by captured CUDA events (measured where they happen).
"""
from __future__ import annotations

import bisect
from typing import NamedTuple

import numpy as np
import torch

from .context import ForwardContext, set_context
from .parallel_state import CollectiveTimer

TIMED_EVERY = 64        # with TP: one decode step in this many measures its collectives
CASCADE = "cascade"     # the context-bound slot of a graph that runs cascade attention
# distinct intervention keys (which layers edit what) with captured graphs; past this, eager
MAX_INTERVENTION_KEYS = 32


class Intervened(NamedTuple):
    """The graph variant of a decode step with interventions: the probe variant it also
    records, and the plan key (which layers ablate / mask / steer). The tables' values are
    static buffers refilled each replay, so one graph serves every request with that key."""
    probe: object
    key: tuple


def graph_buckets(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, 257, 16)) + list(range(320, 1025, 64))
    return [b for b in sizes if b < max_num_seqs] + [max_num_seqs] if max_num_seqs <= 1024 \
        else sizes


def smallest_bucket(buckets: list[int], n: int) -> int | None:
    """The smallest bucket holding n (buckets ascending), or None past the largest: the
    graph a step of n rows (decode) or n tokens (prefill_graphs.py) replays."""
    i = bisect.bisect_left(buckets, n)
    return buckets[i] if i < len(buckets) else None


class DecodeGraphs:
    def __init__(self, runner, max_num_seqs: int):
        self.runner = runner
        dev = runner.device
        self.max_bs = min(max_num_seqs, 1024)
        self.buckets = graph_buckets(self.max_bs)
        bs = runner.block_size
        self.max_blocks = (runner.max_model_len + bs - 1) // bs + 1
        n = self.max_bs
        # [ids | positions | slots] of n rows each, then room for the pending rows and sources
        self.i64 = torch.zeros(5 * n, dtype=torch.int64, device=dev)
        self.input_ids, self.positions, self.slot_mapping = self.i64[:3 * n].view(3, n)
        self.i32 = torch.zeros(n + n * self.max_blocks, dtype=torch.int32, device=dev)
        self.context_lens = self.i32[:n]
        self.block_tables = self.i32[n:].view(n, self.max_blocks)
        self.slot_mapping.fill_(-1)
        # cascade attention's inputs (engine/cascade.py): each row's first key, the lead row
        self.cascade_i32 = torch.zeros(n + 1, dtype=torch.int32, device=dev)
        # key: (bucket, variant, cap); variant None = probes off, else
        # probes.buffers.graph_variant(plan); cap None = any context, else every context <= cap
        from .kernels.decode_attention import context_caps
        caps = runner.kernel_config.attn_context_caps
        self.caps = {b: context_caps(b, runner.num_kv_heads, self.max_blocks * bs, dev, caps)
                     for b in self.buckets} if dev.type == "cuda" else {b: [] for b in self.buckets}
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.logits: dict[tuple, torch.Tensor] = {}
        self.probe_bufs: dict[tuple, object] = {}
        self.iv_bufs: dict[tuple, object] = {}     # plan key -> GraphInterventionBuffers
        self.timers: dict[tuple, CollectiveTimer] = {}     # (bucket, "timed", cap) -> its events
        self.collectives: dict[tuple, int] = {}     # collectives each graph issues per replay
        self.timing = runner.tp.size > 1                    # off for good if capture refuses
        self.replays = 0
        self.pool = torch.cuda.graph_pool_handle()
        self._capture_all()

    # ---- capture -----------------------------------------------------------------------------
    def _ctx(self, bs: int, probes, interventions=None, cap=None) -> ForwardContext:
        cascade = None
        if cap == CASCADE:      # cascade graphs are unbounded: any context, any prefix
            from .kernels.cascade_attention import CascadeInputs
            n = self.max_bs
            cascade = CascadeInputs(self.cascade_i32[:bs], self.cascade_i32[n:n + 1],
                                    self.max_blocks * self.runner.block_size)
            cap = None
        return ForwardContext(slot_mapping=self.slot_mapping[:bs],
                              context_lens=self.context_lens[:bs],
                              block_tables=self.block_tables[:bs], cu_seqlens_q=None,
                              max_seqlen_q=1, is_decode=True, probes=probes,
                              interventions=interventions, max_context_len=cap,
                              cascade=cascade)

    def _run(self, bs: int, probes, interventions=None, cap: int | None = None) -> torch.Tensor:
        set_context(self._ctx(bs, probes, interventions, cap))
        try:
            hidden = self.runner.model(self.input_ids[:bs], self.positions[:bs])
            return self.runner.model.compute_logits(hidden)
        finally:
            set_context(None)

    def _capture(self, bs: int, variant, cap: int | None = None) -> None:
        from .probes.buffers import graph_probe_buffers
        key = (bs, variant, cap)
        timed = variant == "timed"
        ivs, probe_variant = None, variant
        if isinstance(variant, Intervened):
            probe_variant, ivs = variant.probe, self._iv_buffers(variant.key).view(bs)
        probes = graph_probe_buffers(self.runner, bs, probe_variant) \
            if probe_variant is not None and not timed else None
        tp = self.runner.tp
        tp.timer = None                     # the warm-up runs eagerly: no timing there
        with torch.inference_mode():
            self._run(bs, probes, ivs, cap)         # warm-up: compile, allocate scratch
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            # a timed copy records external events (graph event-record nodes) around each
            # collective; any other capture records none
            timer = tp.timer = CollectiveTimer(cuda=True, external=True) if timed else None
            tp.take_collective_count()
            try:
                with torch.cuda.graph(g, pool=self.pool):
                    self.logits[key] = self._run(bs, probes, ivs, cap)
            finally:
                tp.timer = None
            self.collectives[key] = tp.take_collective_count()
        self.graphs[key] = g
        if probes is not None:
            self.probe_bufs[key] = probes
        if timer is not None:
            self.timers[key] = timer

    def _iv_buffers(self, key: tuple):
        """The static intervention tables of one plan key, shared by every bucket."""
        if key not in self.iv_bufs:
            from .interventions.buffers import GraphInterventionBuffers, head_slice_of
            from .interventions.spec import ModelFacts
            r = self.runner
            self.iv_bufs[key] = GraphInterventionBuffers(
                key, self.max_bs, ModelFacts.of(r.hf_config, r.moe_layers), r.device, r.dtype,
                head_slice_of(r))
        return self.iv_bufs[key]

    def _capture_all(self) -> None:
        self.context_lens.fill_(1)          # a valid context for warm-up and capture
        for bs in reversed(self.buckets):
            for cap in [None] + self.caps[bs]:
                self._capture(bs, None, cap)
        self.context_lens.zero_()
        torch.cuda.synchronize()

    def _capture_late(self, bs: int, variant, cap: int | None) -> None:
        """Capture a probe variant between steps. Warm-up and capture run the forward on the
        static inputs, so first make them harmless: no KV write (slot -1), context 1."""
        torch.cuda.synchronize()
        self.slot_mapping.fill_(-1)
        self.context_lens.fill_(1)
        self.cascade_i32.zero_()            # no shared prefix: the prefix kernel writes nothing
        self._capture(bs, variant, cap)
        torch.cuda.synchronize()

    # ---- replay ------------------------------------------------------------------------------
    def bucket(self, batch: int) -> int | None:
        return smallest_bucket(self.buckets, batch)

    def cap(self, bs: int, context_lens: np.ndarray) -> int | None:
        """The smallest context bound of this bucket that holds the step's longest context."""
        caps = self.caps[bs]
        if not caps or not len(context_lens):
            return None
        longest = int(context_lens.max())
        return next((c for c in caps if longest <= c), None)

    def can_run(self, inp, plan) -> bool:
        if self.bucket(inp.num_seqs) is None:
            return False
        if inp.block_tables.shape[1] > self.max_blocks:
            return False
        ip = inp.interventions
        if ip is not None and (ip.captures or ip.num_rows > self.max_bs + 1 or (
                ip.key not in self.iv_bufs and len(self.iv_bufs) >= MAX_INTERVENTION_KEYS)):
            return False
        from .probes.buffers import graph_supports
        return graph_supports(plan, self.runner)

    def _stage(self, inp) -> None:
        """This step's inputs into the static buffers: two pinned host buffers laid out like
        the device ones, two copies (the int32 one only up to this batch's table rows)."""
        n, w, P = self.max_bs, self.max_blocks, len(inp.pending_rows)
        h64 = torch.empty(3 * n + 2 * P, dtype=torch.int64, pin_memory=True)
        h32 = torch.empty(n + inp.num_seqs * w, dtype=torch.int32, pin_memory=True)
        pack_graph_inputs(inp, n, w, h64.numpy(), h32.numpy())
        self.i64[:3 * n + 2 * P].copy_(h64, non_blocking=True)
        self.i32[:n + inp.num_seqs * w].copy_(h32, non_blocking=True)
        if P:
            prev = self.runner.prev_sampled(inp)
            self.input_ids.index_copy_(0, self.i64[3 * n:3 * n + P],
                                       prev.index_select(0, self.i64[3 * n + P:3 * n + 2 * P]))

    def replay(self, inp, plan):
        """-> (logits [B, vocab], the variant's probe buffers or None, bucket, timer,
        collectives replayed, whether it ran cascade attention)."""
        from .probes.buffers import graph_variant
        B = inp.num_seqs
        bs = self.bucket(B)
        variant = graph_variant(plan)
        if inp.interventions is not None:
            variant = Intervened(variant, inp.interventions.key)
        self.replays += 1
        if variant is None and self.timing and self.replays % TIMED_EVERY == 1:
            variant = "timed"
        # only the probe-free graphs are bounded: a probe or intervention variant is captured
        # late, and a watched reply crossing 256 and 512 tokens would stall for a capture at each
        cap = self.cap(bs, inp.context_lens) if variant is None else None
        # a step whose rows share prefix blocks replays a cascade graph (captured at its first
        # use per bucket); a watched, intervened or timed step keeps its own graph, plain
        cascade = inp.cascade is not None and variant is None
        if cascade:
            cap = CASCADE
        if (bs, variant, cap) not in self.graphs:
            try:
                self._capture_late(bs, variant, cap)
            except RuntimeError:
                if variant != "timed":
                    raise
                self.timing, variant = False, None      # timed capture refused: stay untimed
                torch.cuda.synchronize()
        key = (bs, variant, cap)
        self._stage(inp)
        if cascade:
            h = torch.empty(self.max_bs + 1, dtype=torch.int32, pin_memory=True)
            a = h.numpy()
            a[:B], a[B:self.max_bs], a[self.max_bs] = inp.cascade.first, 0, inp.cascade.lead
            self.cascade_i32.copy_(h, non_blocking=True)
        bufs = self.probe_bufs.get(key)
        if bufs is not None:
            bufs.load_plan(plan)
        if inp.interventions is not None:
            self.iv_bufs[inp.interventions.key].load_plan(inp.interventions)
        self.graphs[key].replay()
        return (self.logits[key][:B], bufs, bs, self.timers.get(key),
                self.collectives.get(key, 0), cascade)


def pack_graph_inputs(inp, n: int, max_blocks: int, a64: np.ndarray, a32: np.ndarray) -> None:
    """Lay one decode step out like the graph's static buffers, for n rows (the largest
    bucket) and tables max_blocks wide. a64 [3n + 2P]: ids | positions | slots (padded rows:
    0, 0, -1 — no K/V write), then the pending rows and their sources. a32 [n + B * max_blocks]:
    context lens (padded rows 0: attend to nothing), then the batch's block-table rows."""
    B, nb, P = inp.num_seqs, inp.block_tables.shape[1], len(inp.pending_rows)
    rows = a64[:3 * n].reshape(3, n)
    rows[0, :B], rows[1, :B], rows[2, :B] = inp.input_ids, inp.positions, inp.slot_mapping
    rows[:2, B:] = 0
    rows[2, B:] = -1
    a64[3 * n:3 * n + P] = inp.pending_rows
    a64[3 * n + P:3 * n + 2 * P] = inp.pending_src
    a32[:B] = inp.context_lens
    a32[B:n] = 0
    a32[n:n + B * max_blocks].reshape(B, max_blocks)[:, :nb] = inp.block_tables
