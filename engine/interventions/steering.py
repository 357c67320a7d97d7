"""Steering vectors from two contrasting prompts, the classic recipe: the mean of the residual
stream after decoder layer `layer` (blocks.{layer}.hook_resid_post) over prompt A's tokens,
minus the same mean over prompt B's. The engine computes them: each prompt runs as a request
whose forward sums its prompt's resid_post at that layer (chunked prefill included), never
served from the prefix cache (a cached block's tokens would not be summed)."""
from __future__ import annotations

import secrets

import numpy as np
import torch

from ..sampling import SamplingParams
from .spec import Intervention, _is_int


def steering_vector(llm, layer: int, prompt_a, prompt_b) -> torch.Tensor:
    """[hidden_size] fp32 on the CPU: mean resid_post(prompt_a) - mean resid_post(prompt_b) at
    `layer` (negative counts from the end). Use it as Intervention.steer(layer, v, scale)."""
    L = llm.intervention_facts.num_layers
    if not _is_int(layer) or not -L <= layer < L:
        raise ValueError(f"steering_vector: layer must be an integer in [-{L}, {L}), "
                         f"got {layer!r}")
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    seqs, queues = [], []
    for p in (prompt_a, prompt_b):
        seq, _ = llm._make_sequence(p, params, None, None)
        seq.interventions = (Intervention._capture(layer % L),)
        seq.cache_salt = secrets.randbits(62)      # a chain of its own: no prefix-cache hit
        seqs.append(seq)
        queues.append(llm._submit(seq))
    means = []
    for seq, q in zip(seqs, queues):
        while not llm._next(q).finished:
            pass
        total = getattr(seq, "resid_capture", None)
        if total is None or seq.finish_reason == "abort":
            raise RuntimeError(f"steering_vector: the request for one prompt ({seq.request_id}) "
                               "ended before its residuals were recorded")
        means.append(total / seq.num_prompt_tokens)
    return torch.from_numpy((means[0] - means[1]).astype(np.float32))
