"""CUDA graphs for decode: one graph per batch-size bucket, captured with and without probes.

The probe-free graphs are captured at start-up. Probe-capturing variants — (lens, attention)
on top of norms and routing, see probes/buffers.graph_variant — are captured the first time a watched
request needs one at that bucket: start-up stays as fast as with probes off, and a watch for
norms never pays for the logit lens or the attention rows.

Graph inputs are static device buffers sized for max_num_seqs rows and max_model_len plus one
block of context, so any decode batch up to the largest bucket replays (padded rows get
context_len 0 and slot -1); larger batches run eagerly. Inputs are staged in pinned host
memory and copied without blocking; the only host sync of a step is reading sampled tokens.
"""
from __future__ import annotations

import torch

from .context import ForwardContext, set_context


def graph_buckets(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, 257, 16)) + list(range(320, 1025, 64))
    return [b for b in sizes if b < max_num_seqs] + [max_num_seqs] if max_num_seqs <= 1024 \
        else sizes


class DecodeGraphs:
    def __init__(self, runner, max_num_seqs: int):
        self.runner = runner
        dev = runner.device
        self.max_bs = min(max_num_seqs, 1024)
        self.buckets = graph_buckets(self.max_bs)
        bs = runner.block_size
        self.max_blocks = (runner.max_model_len + bs - 1) // bs + 1
        n = self.max_bs
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=dev)
        self.context_lens = torch.zeros(n, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros(n, self.max_blocks, dtype=torch.int32, device=dev)
        # pinned staging: one host->device copy per buffer, no pageable-memory sync
        self.h_ids = torch.zeros(n, dtype=torch.int64).pin_memory()
        self.h_pos = torch.zeros(n, dtype=torch.int64).pin_memory()
        self.h_slots = torch.zeros(n, dtype=torch.int64).pin_memory()
        self.h_ctx = torch.zeros(n, dtype=torch.int32).pin_memory()
        self.h_tables = torch.zeros(n, self.max_blocks, dtype=torch.int32).pin_memory()
        # key: (bucket, variant); variant None = probes off, else probes.buffers.graph_variant(plan)
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.logits: dict[tuple, torch.Tensor] = {}
        self.probe_bufs: dict[tuple, object] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self._capture_all()

    # ---- capture -----------------------------------------------------------------------------
    def _ctx(self, bs: int, probes) -> ForwardContext:
        return ForwardContext(slot_mapping=self.slot_mapping[:bs],
                              context_lens=self.context_lens[:bs],
                              block_tables=self.block_tables[:bs], cu_seqlens_q=None,
                              max_seqlen_q=1, is_decode=True, probes=probes)

    def _run(self, bs: int, probes) -> torch.Tensor:
        set_context(self._ctx(bs, probes))
        try:
            hidden = self.runner.model(self.input_ids[:bs], self.positions[:bs])
            return self.runner.model.compute_logits(hidden)
        finally:
            set_context(None)

    def _capture(self, bs: int, variant) -> None:
        from .probes.buffers import graph_probe_buffers
        probes = graph_probe_buffers(self.runner, bs, variant) if variant is not None else None
        with torch.inference_mode():
            self._run(bs, probes)                   # warm-up: compile, allocate scratch
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool):
                self.logits[(bs, variant)] = self._run(bs, probes)
        self.graphs[(bs, variant)] = g
        if probes is not None:
            self.probe_bufs[(bs, variant)] = probes

    def _capture_all(self) -> None:
        self.context_lens.fill_(1)          # a valid context for warm-up and capture
        for bs in reversed(self.buckets):
            self._capture(bs, None)
        self.context_lens.zero_()
        torch.cuda.synchronize()

    def _capture_late(self, bs: int, variant) -> None:
        """Capture a probe variant between steps. Warm-up and capture run the forward on the
        static inputs, so first make them harmless: no KV write (slot -1), context 1."""
        torch.cuda.synchronize()
        self.slot_mapping.fill_(-1)
        self.context_lens.fill_(1)
        self._capture(bs, variant)
        torch.cuda.synchronize()

    # ---- replay ------------------------------------------------------------------------------
    def bucket(self, batch: int) -> int | None:
        for b in self.buckets:
            if b >= batch:
                return b
        return None

    def can_run(self, inp, plan) -> bool:
        if self.bucket(len(inp.context_lens)) is None:
            return False
        if inp.block_tables.shape[1] > self.max_blocks:
            return False
        from .probes.buffers import graph_supports
        return graph_supports(plan, self.runner)

    def replay(self, inp, plan):
        """-> (logits [B, vocab], the variant's probe buffers or None)."""
        from .probes.buffers import graph_variant
        B = len(inp.context_lens)
        bs = self.bucket(B)
        variant = graph_variant(plan)
        if (bs, variant) not in self.graphs:
            self._capture_late(bs, variant)
        nb = inp.block_tables.shape[1]
        self.h_ids[:B] = inp.input_ids
        self.h_pos[:B] = inp.positions
        self.h_slots[:B] = inp.slot_mapping
        self.h_slots[B:bs] = -1
        self.h_ctx[:B] = inp.context_lens
        self.h_ctx[B:bs] = 0
        self.h_tables[:B, :nb] = inp.block_tables
        self.input_ids[:bs].copy_(self.h_ids[:bs], non_blocking=True)
        self.positions[:bs].copy_(self.h_pos[:bs], non_blocking=True)
        self.slot_mapping[:bs].copy_(self.h_slots[:bs], non_blocking=True)
        self.context_lens[:bs].copy_(self.h_ctx[:bs], non_blocking=True)
        self.block_tables[:B, :nb].copy_(self.h_tables[:B, :nb], non_blocking=True)
        bufs = self.probe_bufs.get((bs, variant))
        if bufs is not None:
            bufs.load_plan(plan)
        self.graphs[(bs, variant)].replay()
        self.runner._graph_bucket = bs
        return self.logits[(bs, variant)][:B], bufs
