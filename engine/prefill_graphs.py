"""CUDA graphs for prefill: one graph per token bucket, for steps of up to MAX_SEQS sequences.

Why: an eager 28-layer prefill is ~270 kernel launches at ~33 µs of host time each (~9 ms of
host for 3 ms of kernels at 1,024 tokens), so the time to first token was the host's.

The forward reads its shapes from the padded token count alone: the paged prefill attention
takes cu_seqlens / context lens from device memory and a grid fixed at the bucket (tiles past a
sequence's length return at once; padded sequences have q_len 0, context 0). Padded tokens (id
0, position 0, slot -1) write no K/V and every other op is row-wise, so they never touch a real
row, and only real rows are sampled. Watched prefills replay a probe variant per
(bucket, graph_variant) captured at first use, as decode does; more than one watched request,
prompt attention patterns, a bucket past the MoE router's stacked buffers, interventions and
prompt logprobs run eagerly. Inputs are staged as in cuda_graphs.py.
"""
from __future__ import annotations

import numpy as np
import torch

from .context import ForwardContext, set_context
from .cuda_graphs import smallest_bucket

MAX_SEQS = 4                # sequences per graphed prefill step (chat turns arrive one by one)
# sampled rows per graphed step: a speculative verify samples 1 + k rows of one sequence
# (engine/spec_decode); the LM head reads its weights once whatever the row count
MAX_SAMPLE_ROWS = 32
TOKEN_BUCKETS = (16, 32, 64, 128, 256, 512, 768, 1024, 1536, 2048)


def token_buckets(max_tokens: int) -> list[int]:
    return [b for b in TOKEN_BUCKETS if b <= max_tokens] or [TOKEN_BUCKETS[0]]


class PrefillGraphs:
    def __init__(self, runner, max_num_batched_tokens: int):
        self.runner = runner
        dev = runner.device
        self.buckets = token_buckets(max_num_batched_tokens)
        self.max_tokens = self.buckets[-1]
        self.max_seqs = S = MAX_SEQS
        self.max_sample_rows = R = max(MAX_SAMPLE_ROWS, S)
        bs = runner.block_size
        self.max_blocks = (runner.max_model_len + bs - 1) // bs + 1
        T = self.max_tokens
        # int64: ids | positions | slots (T each) | sample rows (R) | pending rows, sources (S each)
        self.i64 = torch.zeros(3 * T + R + 2 * S, dtype=torch.int64, device=dev)
        self.input_ids, self.positions, self.slot_mapping = self.i64[:3 * T].view(3, T)
        self.sample_rows = self.i64[3 * T:3 * T + R]
        # int32: cu_seqlens (S + 1) | context lens (S) | block tables (S x max_blocks)
        self.i32 = torch.zeros(2 * S + 1 + S * self.max_blocks, dtype=torch.int32, device=dev)
        self.cu_seqlens = self.i32[:S + 1]
        self.context_lens = self.i32[S + 1:2 * S + 1]
        self.block_tables = self.i32[2 * S + 1:].view(S, self.max_blocks)
        # key: (bucket, variant); variant None = probes off, else graph_variant(plan)
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.logits: dict[tuple, torch.Tensor] = {}
        self.collectives: dict[tuple, int] = {}    # collectives each graph issues per replay
        self.probe_bufs: dict[tuple, object] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self._capture_all()

    # ---- capture -----------------------------------------------------------------------------
    def _run(self, T: int, probes=None) -> torch.Tensor:
        set_context(ForwardContext(
            slot_mapping=self.slot_mapping[:T], context_lens=self.context_lens,
            block_tables=self.block_tables, cu_seqlens_q=self.cu_seqlens, max_seqlen_q=T,
            is_decode=False, probes=probes))
        try:
            hidden = self.runner.model(self.input_ids[:T], self.positions[:T])
            return self.runner.model.compute_logits(hidden.index_select(0, self.sample_rows))
        finally:
            set_context(None)

    def _harmless(self, T: int) -> None:
        """Inputs for warm-up and capture: one sequence of T tokens (ids, positions and the
        sampled rows 0: a later capture at a smaller bucket must not see the last replay's
        rows, e.g. row 1,023 of a 1,024-token prompt, past its T), no K/V written (slots -1),
        every table entry block 0 (valid memory to read)."""
        self.i64.zero_()
        self.slot_mapping.fill_(-1)
        self.block_tables.zero_()
        self.cu_seqlens.copy_(torch.tensor([0] + [T] * self.max_seqs, dtype=torch.int32))
        self.context_lens.zero_()
        self.context_lens[0] = T

    def _capture(self, T: int, variant) -> None:
        from .probes.buffers import graph_probe_buffers
        probes = (graph_probe_buffers(self.runner, T, variant, prefill=True)
                  if variant is not None else None)
        tp = self.runner.tp
        self._harmless(T)
        with torch.inference_mode():
            self._run(T, probes)                    # warm-up: compile, allocate scratch
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            tp.timer = None
            tp.take_collective_count()
            with torch.cuda.graph(g, pool=self.pool):
                self.logits[(T, variant)] = self._run(T, probes)
            self.collectives[(T, variant)] = tp.take_collective_count()
        self.graphs[(T, variant)] = g
        if probes is not None:
            self.probe_bufs[(T, variant)] = probes

    def _capture_all(self) -> None:
        for T in reversed(self.buckets):
            self._capture(T, None)
        self.context_lens.zero_()
        torch.cuda.synchronize()

    def _capture_late(self, T: int, variant) -> None:
        """A probe variant, the first time a watched prompt needs it, between steps (the
        static inputs are refilled by every replay, so overwriting them here is harmless)."""
        torch.cuda.synchronize()
        self._capture(T, variant)
        self.context_lens.zero_()
        torch.cuda.synchronize()

    # ---- replay ------------------------------------------------------------------------------
    def bucket(self, num_tokens: int) -> int | None:
        return smallest_bucket(self.buckets, num_tokens)

    def can_run(self, inp, plan) -> bool:
        if (inp.is_decode or inp.interventions is not None or inp.prompt_lp_rows is not None
                or inp.num_seqs > self.max_seqs or len(inp.sample_rows) > self.max_sample_rows
                or inp.block_tables.shape[1] > self.max_blocks):
            return False
        T = self.bucket(inp.num_tokens)
        if T is None:
            return False
        from .probes.buffers import prefill_graph_supports
        return prefill_graph_supports(plan, self.runner, T)

    def replay(self, inp, plan=None) -> tuple[torch.Tensor, object, int, int]:
        """-> (logits of the sampled rows [S, vocab], the variant's probe buffers or None,
        the token bucket replayed, collectives replayed)."""
        from .probes.buffers import graph_variant
        T = self.bucket(inp.num_tokens)
        key = (T, graph_variant(plan))
        if key not in self.graphs:
            self._capture_late(*key)
        S, R, P = self.max_seqs, self.max_sample_rows, len(inp.pending_rows)
        h64 = torch.empty(3 * self.max_tokens + R + 2 * P, dtype=torch.int64, pin_memory=True)
        h32 = torch.empty(2 * S + 1 + inp.num_seqs * self.max_blocks, dtype=torch.int32,
                          pin_memory=True)
        pack_prefill_inputs(inp, self.max_tokens, T, S, self.max_blocks, h64.numpy(),
                            h32.numpy(), R)
        self.i64[:h64.shape[0]].copy_(h64, non_blocking=True)
        self.i32[:h32.shape[0]].copy_(h32, non_blocking=True)
        if P:
            prev = self.runner.prev_sampled(inp)
            base = 3 * self.max_tokens + R
            self.input_ids.index_copy_(0, self.i64[base:base + P],
                                       prev.index_select(0, self.i64[base + P:base + 2 * P]))
        bufs = self.probe_bufs.get(key)
        if bufs is not None:
            bufs.load_plan(plan)
        self.graphs[key].replay()
        return self.logits[key][:len(inp.sample_rows)], bufs, T, self.collectives[key]


def pack_prefill_inputs(inp, max_tokens: int, T: int, S: int, max_blocks: int,
                        a64: np.ndarray, a32: np.ndarray, R: int | None = None) -> None:
    """Lay one prefill step out like the static buffers. a64: ids | positions | slots, each
    max_tokens long (padded tokens up to the bucket T: 0, 0, -1), then the R sample rows (R: S
    unless given; padded with row 0), then the pending rows and their sources. a32: cu_seqlens
    (padded sequences repeat the total: q_len 0), context lens (padded 0), the block tables."""
    N, B, P = inp.num_tokens, inp.num_seqs, len(inp.pending_rows)
    rows = a64[:3 * max_tokens].reshape(3, max_tokens)
    rows[0, :N], rows[1, :N], rows[2, :N] = inp.input_ids, inp.positions, inp.slot_mapping
    rows[:2, N:T] = 0
    rows[2, N:T] = -1
    base = 3 * max_tokens
    R = S if R is None else R
    n_s = len(inp.sample_rows)
    a64[base:base + n_s] = inp.sample_rows
    a64[base + n_s:base + R] = 0
    a64[base + R:base + R + P] = inp.pending_rows
    a64[base + R + P:base + R + 2 * P] = inp.pending_src
    a32[:B + 1] = inp.cu_seqlens_q
    a32[B + 1:S + 1] = inp.cu_seqlens_q[-1]
    a32[S + 1:S + 1 + B] = inp.context_lens
    a32[S + 1 + B:2 * S + 1] = 0
    nb = inp.block_tables.shape[1]
    a32[2 * S + 1:2 * S + 1 + B * max_blocks].reshape(B, max_blocks)[:, :nb] = inp.block_tables
