"""Presence, frequency and repetition penalties and logit_bias, applied to a step's logits from
per-request count rows that live on the device across steps (no host sync, O(batch) host work).

- repetition_penalty (HF's / vLLM's): a positive logit of a token in the prompt or output so
  far is divided by it, a negative one multiplied;
- frequency / presence_penalty (OpenAI's): logit -= frequency * count + presence * (count > 0),
  over the output tokens only;
- logit_bias (OpenAI's): added to the token's logit, before the penalties (vLLM's order).

Each penalised request owns a count row (a slot, from penalty_slots.PenaltySlots on rank 0). A
step's PenaltyBatch carries only what changed since the request's previous step; every rank
applies the same updates to its own copy, so the rows agree without communication.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

_I64 = np.int64


def needs_counts(params) -> bool:
    """A presence, frequency or repetition penalty: the request needs a count row."""
    return (params.presence_penalty != 0.0 or params.frequency_penalty != 0.0
            or params.repetition_penalty != 1.0)


@dataclass
class PenaltyBatch:
    """One step's penalty work as host arrays (sent to every rank with the StepInputs)."""
    rows: np.ndarray            # [P] int64: sampled rows with a count penalty
    slots: np.ndarray           # [P] int64: their count rows
    presence: np.ndarray        # [P] fp32
    frequency: np.ndarray       # [P] fp32
    repetition: np.ndarray      # [P] fp32
    num_slots: int              # count rows the device must hold (highest slot + 1)
    reset_slots: np.ndarray     # [R] int64: rows cleared before this step's additions
    seen_slots: np.ndarray      # [Q] int64: (slot, token) of each distinct prompt token
    seen_tokens: np.ndarray     #      (repetition rows, sent when their row is cleared)
    add_slots: np.ndarray       # [A] int64: (slot, token) output tokens known on the host
    add_tokens: np.ndarray
    pending_slots: np.ndarray   # [D] int64: output tokens still on the device: their index in
    pending_src: np.ndarray     #      the previous step's sampled ids
    bias_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, _I64))  # [K] logit_bias
    bias_tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, _I64))
    bias_values: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    # speculative decoding: verify row j of a request counts its drafts 0..j-1 as output too.
    # Such a row reads a scratch row: a copy of the request's row taken after this step's
    # additions (copy_src -> copy_dst), plus those drafts (draft_slots, draft_tokens)
    copy_src: np.ndarray = field(default_factory=lambda: np.zeros(0, _I64))
    copy_dst: np.ndarray = field(default_factory=lambda: np.zeros(0, _I64))
    draft_slots: np.ndarray = field(default_factory=lambda: np.zeros(0, _I64))
    draft_tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, _I64))

    _INTS = ("rows", "slots", "reset_slots", "seen_slots", "seen_tokens", "add_slots",
             "add_tokens", "pending_slots", "pending_src", "bias_rows", "bias_tokens",
             "copy_src", "copy_dst", "draft_slots", "draft_tokens")
    _FLOATS = ("presence", "frequency", "repetition", "bias_values")


@dataclass
class PenaltyTensors:
    """A step's penalty inputs on the device (views of two staged arrays) and the count rows."""
    rows: torch.Tensor
    slots: torch.Tensor
    presence: torch.Tensor
    frequency: torch.Tensor
    repetition: torch.Tensor
    bias_rows: torch.Tensor
    bias_tokens: torch.Tensor
    bias_values: torch.Tensor
    counts: torch.Tensor        # [S, V] int32
    prompt_seen: torch.Tensor   # [S, V] bool


class PenaltyState:
    """The count rows on one rank's device, grown (by doubling) when more requests need one."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.counts: torch.Tensor | None = None         # [S, V] int32
        self.prompt_seen: torch.Tensor | None = None    # [S, V] bool

    def _ensure(self, num_slots: int, vocab: int) -> None:
        have = 0 if self.counts is None else self.counts.shape[0]
        if self.counts is not None and self.counts.shape[1] != vocab:
            raise RuntimeError(f"penalty count rows are {self.counts.shape[1]} wide, the "
                               f"logits {vocab}")
        if num_slots <= have:
            return
        size = max(num_slots, 2 * have, 8)
        counts = torch.zeros(size, vocab, dtype=torch.int32, device=self.device)
        seen = torch.zeros(size, vocab, dtype=torch.bool, device=self.device)
        if have:
            counts[:have] = self.counts
            seen[:have] = self.prompt_seen
        self.counts, self.prompt_seen = counts, seen

    def _stage(self, a: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(a)
        if self.device.type != "cuda":
            return t
        return t.pin_memory().to(self.device, non_blocking=True)

    def step(self, b: PenaltyBatch, vocab: int, prev_sampled: torch.Tensor | None
             ) -> PenaltyTensors:
        """Bring the count rows up to date with `b` (queued on the device, no sync) and return
        the tensors the sampler applies. Two host->device copies: one int64, one fp32."""
        ints = [getattr(b, n) for n in PenaltyBatch._INTS]
        floats = [getattr(b, n) for n in PenaltyBatch._FLOATS]
        di = self._stage(np.concatenate(ints).astype(_I64, copy=False)).split(
            [len(a) for a in ints])
        df = self._stage(np.concatenate(floats).astype(np.float32, copy=False)).split(
            [len(a) for a in floats])
        i = dict(zip(PenaltyBatch._INTS, di))
        f = dict(zip(PenaltyBatch._FLOATS, df))
        if b.num_slots:
            self._ensure(b.num_slots, vocab)
            if len(b.reset_slots):
                self.counts.index_fill_(0, i["reset_slots"], 0)
                self.prompt_seen.index_fill_(0, i["reset_slots"], False)
            if len(b.seen_slots):
                self.prompt_seen.index_put_((i["seen_slots"], i["seen_tokens"]),
                                            torch.ones((), dtype=torch.bool, device=self.device))
            slots, toks = i["add_slots"], i["add_tokens"]
            if len(b.pending_slots):
                if prev_sampled is None:
                    raise RuntimeError("a penalised row's newest token is on the device, but "
                                       "the previous step's sampled ids are not")
                slots = torch.cat([slots, i["pending_slots"]])
                toks = torch.cat([toks, prev_sampled.index_select(0, i["pending_src"])])
            one = torch.ones((), dtype=torch.int32, device=self.device)
            if len(slots):
                self.counts.index_put_((slots, toks), one, accumulate=True)
            if len(b.copy_dst):         # verify rows: scratch copies, then their drafts
                src, dst = i["copy_src"], i["copy_dst"]
                self.counts.index_copy_(0, dst, self.counts.index_select(0, src))
                self.prompt_seen.index_copy_(0, dst, self.prompt_seen.index_select(0, src))
                if len(b.draft_slots):
                    self.counts.index_put_((i["draft_slots"], i["draft_tokens"]), one,
                                           accumulate=True)
        empty = torch.zeros(0, 0, dtype=torch.int32, device=self.device)
        return PenaltyTensors(
            i["rows"], i["slots"], f["presence"], f["frequency"], f["repetition"],
            i["bias_rows"], i["bias_tokens"], f["bias_values"],
            self.counts if self.counts is not None else empty,
            self.prompt_seen if self.prompt_seen is not None else empty.bool())


def apply_penalties(logits: torch.Tensor, t: PenaltyTensors) -> torch.Tensor:
    """logits [B, V] fp32 -> a penalised copy (logit_bias first, then the count penalties)."""
    logits = logits.clone()
    if len(t.bias_rows):
        logits.index_put_((t.bias_rows, t.bias_tokens), t.bias_values, accumulate=True)
    if not len(t.rows):
        return logits
    if logits.is_cuda:
        from .kernels.penalties_kernel import apply_count_penalties as apply
    else:
        from .kernels.penalties_kernel import apply_count_penalties_ref as apply
    return apply(logits, t.rows, t.slots, t.counts, t.prompt_seen, t.presence, t.frequency,
                 t.repetition)
