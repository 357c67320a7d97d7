"""The device sampler: greedy, temperature, top-k, top-p, min-p, seeds, logprobs, vectorised
over the batch. Seeded randomness is a counter-based hash (sampling_noise.py), so a request's
draws do not depend on what else is in the batch. SamplingParams is re-exported here.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .sampling_noise import uniform_noise
from .sampling_params import SamplingParams

__all__ = ["SamplingParams", "SamplingTensors", "apply_filters", "sample", "uniform_noise"]


@dataclass
class SamplingTensors:
    """Per-row settings for one step, as device tensors."""
    temperature: torch.Tensor   # [B] fp32 (0 = greedy)
    top_k: torch.Tensor         # [B] int64 (0 = off)
    top_p: torch.Tensor         # [B] fp32
    min_p: torch.Tensor         # [B] fp32
    seeds: torch.Tensor         # [B] int64
    positions: torch.Tensor     # [B] int64: index of the token being sampled (for the noise)
    all_greedy: bool
    need_sort: bool             # any top-k / top-p
    need_min_p: bool
    max_logprobs: int
    banned: list[tuple[int, int]]   # (row, token) pairs masked for min_tokens
    penalties: object = None        # penalties.PenaltyTensors, None when no row uses one
    grammar_mask: torch.Tensor | None = None    # [B, ceil(V/32)] int32 allowed-token bits

    @classmethod
    def build(cls, params: list[SamplingParams], seeds: list[int], positions: list[int],
              banned: list[tuple[int, int]], device) -> "SamplingTensors":
        from .step_inputs import SamplingBatch
        return cls.from_batch(SamplingBatch.build(params, seeds, positions, banned), device)

    @classmethod
    def from_batch(cls, b, device) -> "SamplingTensors":
        """A step_inputs.SamplingBatch (host lists) -> tensors on `device`. The penalties'
        tensors come from the runner's persistent count rows (penalties.PenaltyState.step).

        Every per-row setting and the grammar mask cross in one packed buffer: one pinned
        allocation and one non-blocking copy, the tensors views of it (was a tensor, a pin and
        a copy each: ~20 host calls on a host-bound batch-1 step)."""
        B = len(b.seeds)
        temps = b.temperature
        mask = getattr(b, "grammar_mask", None)
        cuda = torch.device(device).type == "cuda"
        all_greedy = all(x == 0.0 for x in temps)
        n_mask = mask.size if mask is not None else 0
        # int64 top_k | seeds | positions, then fp32 temperature | top_p | min_p, then the mask
        # (offsets stay multiples of each dtype's size: 24 B, then 12 B per row)
        o32, om = 24 * B, 36 * B
        host = torch.empty(om + 4 * n_mask, dtype=torch.uint8,
                           pin_memory=cuda and (mask is not None or not all_greedy))
        h = host.numpy()
        h64 = h[:o32].view(np.int64).reshape(3, B)
        h64[0], h64[1], h64[2] = b.top_k, b.seeds, b.positions
        h32 = h[o32:om].view(np.float32).reshape(3, B)
        h32[0], h32[1], h32[2] = temps, b.top_p, b.min_p
        if mask is not None:
            h[om:].view(np.int32).reshape(mask.shape)[...] = mask
        # (pinned: the copy is queued, the caching host allocator keeps the buffer until it ran)
        dev = host.to(device, non_blocking=True) if cuda and host.is_pinned() else host
        # argmax needs none of the per-row tensors: an all-greedy batch keeps them on the host
        rows = host if all_greedy else dev
        i64 = rows[:o32].view(torch.int64).view(3, B)
        f32 = rows[o32:om].view(torch.float32).view(3, B)
        t = cls(temperature=f32[0], top_k=i64[0], top_p=f32[1], min_p=f32[2], seeds=i64[1],
                positions=i64[2], all_greedy=all_greedy,
                need_sort=any(k > 0 for k in b.top_k) or any(p < 1.0 for p in b.top_p),
                need_min_p=any(m > 0 for m in b.min_p), max_logprobs=b.max_logprobs,
                banned=b.banned)
        if mask is not None:
            t.grammar_mask = dev[om:].view(torch.int32).view(mask.shape)
        return t


def apply_filters(probs: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Zero the probabilities that top-k, top-p and min-p exclude. probs: [B, V] fp32."""
    if t.need_min_p:
        pmax = probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < t.min_p[:, None] * pmax, 0.0)
    if t.need_sort:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        rank = torch.arange(probs.shape[-1], device=probs.device)[None, :]
        cut = (t.top_k[:, None] > 0) & (rank >= t.top_k[:, None])
        # keep the smallest prefix whose mass reaches top_p (the token that crosses is kept)
        cum_before = sorted_p.cumsum(dim=-1) - sorted_p
        cut |= cum_before >= t.top_p[:, None] * sorted_p.sum(-1, keepdim=True) - 1e-7
        cut[:, 0] = False
        sorted_p = sorted_p.masked_fill(cut, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    return probs


def sample(logits: torch.Tensor, t: SamplingTensors):
    """logits [B, V] -> (token ids [B] int64, logprobs [B] fp32, top ids [B,k], top lps [B,k]).
    The logprob outputs are None when no request in the batch asked for logprobs."""
    logits = logits.float()
    if t.penalties is not None:     # before min_tokens' -inf: a penalty must not revive a ban
        from .penalties import apply_penalties
        logits = apply_penalties(logits, t.penalties)
    if t.grammar_mask is not None:  # structured output: tokens the grammar forbids are -inf
        from .guided import apply_bitmask
        logits = apply_bitmask(logits, t.grammar_mask)
    if t.banned:
        rows, toks = zip(*t.banned)
        # a copy: fp32 logits from the runner are inference tensors and must not be written
        logits = logits.clone()
        logits[list(rows), list(toks)] = float("-inf")
    if t.all_greedy:
        tokens = logits.argmax(dim=-1)
    elif logits.is_cuda and not t.need_sort and not t.need_min_p:
        # plain temperature (greedy rows mixed in): one fused pass, the same draw as below up to
        # rounding, instead of softmax and ~20 [B, V] int64 passes for the noise
        from engine.kernels.sampling_kernel import gumbel_argmax
        tokens = gumbel_argmax(logits, t.temperature, t.seeds, t.positions)
    else:
        temp = t.temperature.clamp_min(1e-6)[:, None]
        probs = torch.softmax(logits / temp, dim=-1)
        probs = apply_filters(probs, t)
        # exponential race: argmax p_i / E_i with E_i ~ Exp(1) draws i with probability p_i
        e = -torch.log(uniform_noise(t.seeds, t.positions, logits.shape[-1]))
        sampled = (probs / e).argmax(dim=-1)
        tokens = torch.where(t.temperature == 0, logits.argmax(dim=-1), sampled)
    if not t.max_logprobs:          # nobody asked: no log-softmax over the vocabulary
        return tokens, None, None, None
    logprobs = torch.log_softmax(logits, dim=-1)
    chosen_lp = logprobs.gather(-1, tokens[:, None]).squeeze(-1)
    top_lp, top_ids = logprobs.topk(t.max_logprobs, dim=-1)
    return tokens, chosen_lp, top_ids, top_lp
