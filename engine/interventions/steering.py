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
from ..sampling_params import is_int
from .spec import Intervention


def steering_vector(llm, layer: int, prompt_a, prompt_b) -> torch.Tensor:
    """[hidden_size] fp32 on the CPU: mean resid_post(prompt_a) - mean resid_post(prompt_b) at
    `layer` (negative counts from the end). Use it as Intervention.steer(layer, v, scale)."""
    L = llm.intervention_facts.num_layers
    if not is_int(layer) or not -L <= layer < L:
        raise ValueError(f"steering_vector: layer must be an integer in [-{L}, {L}), "
                         f"got {layer!r}")
    import dataclasses
    import queue
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    reqs = [dataclasses.replace(llm.process(p, params),
                                interventions=(Intervention._capture(layer % L),),
                                cache_root=secrets.randbits(62))   # its own chain: no cache hit
            for p in (prompt_a, prompt_b)]
    queues = [queue.Queue() for _ in reqs]
    llm.loop.add(reqs, [q.put for q in queues])
    means = []
    for req, q in zip(reqs, queues):
        ev = q.get()
        while not isinstance(ev, BaseException) and not ev.finished:
            ev = q.get()
        if isinstance(ev, BaseException) or ev.resid_capture is None or \
                ev.finish_reason == "abort":
            raise RuntimeError(f"steering_vector: the request for one prompt ({req.request_id}) "
                               f"ended before its residuals were recorded: {ev!r:.200}")
        means.append(ev.resid_capture / len(req.prompt))
    return torch.from_numpy((means[0] - means[1]).astype(np.float32))
