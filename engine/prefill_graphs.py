"""CUDA graphs for prefill: one graph per token bucket, for steps of up to MAX_SEQS sequences.

Why: an eager 28-layer prefill is ~270 kernel launches at ~33 µs of Python and launcher each
(~9 ms of host time for 3 ms of kernels at 1,024 tokens), so the time to first token was the
host's. Replayed as a graph, the launch is one call.

What makes a prefill graphable here: the whole forward reads its shapes from the padded token
count alone. The paged prefill attention kernel takes cu_seqlens / context lens from device
memory and a grid sized by `max_seqlen_q`, which the graph fixes at the bucket: tiles past a
sequence's real length return at once, and padded sequences (q_len 0, context 0) do nothing.
Padded tokens (id 0, position 0, slot -1) write no K/V and belong to no sequence; every other
op is row-wise, so their rows never touch a real one, and only real rows are sampled.

Used for steps without probes, interventions or prompt logprobs (those run eagerly, as
before), with at most MAX_SEQS sequences and MAX_TOKENS tokens. Graph inputs are static device
buffers filled by two non-blocking copies from pinned memory allocated per step (overlap
scheduling prepares step N+1 before step N's copies ran: a reused staging buffer would race).
With tensor parallelism every rank captures the same buckets and replays them in lockstep.
"""
from __future__ import annotations

import numpy as np
import torch

from .context import ForwardContext, set_context
from .cuda_graphs import smallest_bucket

MAX_SEQS = 4                # sequences per graphed prefill step (chat turns arrive one by one)
TOKEN_BUCKETS = (16, 32, 64, 128, 256, 512, 768, 1024, 1536, 2048)


def token_buckets(max_tokens: int) -> list[int]:
    return [b for b in TOKEN_BUCKETS if b <= max_tokens] or [TOKEN_BUCKETS[0]]


class PrefillGraphs:
    def __init__(self, runner, max_num_batched_tokens: int, max_seqs: int = MAX_SEQS):
        self.runner = runner
        dev = runner.device
        self.buckets = token_buckets(max_num_batched_tokens)
        self.max_tokens = self.buckets[-1]
        self.max_seqs = S = max_seqs
        bs = runner.block_size
        self.max_blocks = (runner.max_model_len + bs - 1) // bs + 1
        T = self.max_tokens
        # int64: ids | positions | slots (T each) | sample rows (S) | pending rows, sources (S each)
        self.i64 = torch.zeros(3 * T + 3 * S, dtype=torch.int64, device=dev)
        self.input_ids, self.positions, self.slot_mapping = self.i64[:3 * T].view(3, T)
        self.sample_rows = self.i64[3 * T:3 * T + S]
        # int32: cu_seqlens (S + 1) | context lens (S) | block tables (S x max_blocks)
        self.i32 = torch.zeros(2 * S + 1 + S * self.max_blocks, dtype=torch.int32, device=dev)
        self.cu_seqlens = self.i32[:S + 1]
        self.context_lens = self.i32[S + 1:2 * S + 1]
        self.block_tables = self.i32[2 * S + 1:].view(S, self.max_blocks)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.collectives: dict[int, int] = {}      # collectives each graph issues per replay
        self.pool = torch.cuda.graph_pool_handle()
        self._capture_all()

    # ---- capture -----------------------------------------------------------------------------
    def _run(self, T: int) -> torch.Tensor:
        set_context(ForwardContext(
            slot_mapping=self.slot_mapping[:T], context_lens=self.context_lens,
            block_tables=self.block_tables, cu_seqlens_q=self.cu_seqlens, max_seqlen_q=T,
            is_decode=False))
        try:
            hidden = self.runner.model(self.input_ids[:T], self.positions[:T])
            return self.runner.model.compute_logits(hidden.index_select(0, self.sample_rows))
        finally:
            set_context(None)

    def _capture_all(self) -> None:
        # harmless inputs for warm-up and capture: one sequence of T tokens, no K/V written
        # (slots -1), every table entry block 0 (valid memory to read)
        self.slot_mapping.fill_(-1)
        tp = self.runner.tp
        with torch.inference_mode():
            for T in reversed(self.buckets):
                self.cu_seqlens.copy_(torch.tensor([0] + [T] * self.max_seqs, dtype=torch.int32))
                self.context_lens.zero_()
                self.context_lens[0] = T
                self._run(T)                        # warm-up: compile, allocate scratch
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                tp.timer = None
                tp.take_collective_count()
                with torch.cuda.graph(g, pool=self.pool):
                    self.logits[T] = self._run(T)
                self.collectives[T] = tp.take_collective_count()
                self.graphs[T] = g
        self.context_lens.zero_()
        torch.cuda.synchronize()

    # ---- replay ------------------------------------------------------------------------------
    def bucket(self, num_tokens: int) -> int | None:
        return smallest_bucket(self.buckets, num_tokens)

    def can_run(self, inp, plan) -> bool:
        return (not inp.is_decode and plan is None and inp.interventions is None
                and inp.prompt_lp_rows is None and inp.num_seqs <= self.max_seqs
                and len(inp.sample_rows) <= self.max_seqs
                and self.bucket(inp.num_tokens) is not None
                and inp.block_tables.shape[1] <= self.max_blocks)

    def replay(self, inp) -> tuple[torch.Tensor, int, int]:
        """-> (logits of the sampled rows [S, vocab], the token bucket replayed, collectives
        replayed)."""
        T = self.bucket(inp.num_tokens)
        S, P = self.max_seqs, len(inp.pending_rows)
        h64 = torch.empty(3 * self.max_tokens + S + 2 * P, dtype=torch.int64, pin_memory=True)
        h32 = torch.empty(2 * S + 1 + inp.num_seqs * self.max_blocks, dtype=torch.int32,
                          pin_memory=True)
        pack_prefill_inputs(inp, self.max_tokens, T, S, self.max_blocks, h64.numpy(),
                            h32.numpy())
        self.i64[:h64.shape[0]].copy_(h64, non_blocking=True)
        self.i32[:h32.shape[0]].copy_(h32, non_blocking=True)
        if P:
            prev = self.runner.prev_sampled(inp)
            base = 3 * self.max_tokens + S
            self.input_ids.index_copy_(0, self.i64[base:base + P],
                                       prev.index_select(0, self.i64[base + P:base + 2 * P]))
        self.graphs[T].replay()
        return self.logits[T][:len(inp.sample_rows)], T, self.collectives[T]


def pack_prefill_inputs(inp, max_tokens: int, T: int, S: int, max_blocks: int,
                        a64: np.ndarray, a32: np.ndarray) -> None:
    """Lay one prefill step out like the static buffers. a64: ids | positions | slots, each
    max_tokens long (padded tokens up to the bucket T: 0, 0, -1), then the S sample rows (padded
    with row 0), then the pending rows and their sources. a32: cu_seqlens (padded sequences
    repeat the total: q_len 0), context lens (padded 0), the batch's block-table rows."""
    N, B, P = inp.num_tokens, inp.num_seqs, len(inp.pending_rows)
    rows = a64[:3 * max_tokens].reshape(3, max_tokens)
    rows[0, :N], rows[1, :N], rows[2, :N] = inp.input_ids, inp.positions, inp.slot_mapping
    rows[:2, N:T] = 0
    rows[2, N:T] = -1
    base = 3 * max_tokens
    n_s = len(inp.sample_rows)
    a64[base:base + n_s] = inp.sample_rows
    a64[base + n_s:base + S] = 0
    a64[base + S:base + S + P] = inp.pending_rows
    a64[base + S + P:base + S + 2 * P] = inp.pending_src
    a32[:B + 1] = inp.cu_seqlens_q
    a32[B + 1:S + 1] = inp.cu_seqlens_q[-1]
    a32[S + 1:S + 1 + B] = inp.context_lens
    a32[S + 1 + B:2 * S + 1] = 0
    nb = inp.block_tables.shape[1]
    a32[2 * S + 1:2 * S + 1 + B * max_blocks].reshape(B, max_blocks)[:, :nb] = inp.block_tables
