"""The bandwidth floor of a MoE run: the bytes each engine step must read at its batch, summed
over the run's steps (the engine's step traces), over the measured copy bandwidth.

A step reads, at the least:
- experts: in each MoE layer, every expert that one of the step's tokens routes to, once. Either
  counted from the run (the engine's expert load per step, `record_expert_load=True`) or, for B
  tokens, the uniform-routing expectation E * (1 - (1 - k/E)^B) (a token's k experts are
  distinct, so an expert escapes one token with probability 1 - k/E);
- dense weights: everything else the forward multiplies by (attention projections, norms, router
  gates, shared experts, dense MLPs, the LM head), plus one embedding row per token;
- the KV cache: K and V of every token each scheduled request attends over.
Only real tokens count: the rows a CUDA-graph bucket pads with are the engine's cost, not the
workload's. Time per step = bytes / copy bandwidth (read + write bytes of a device copy, as
bench/common.py measures it); FLOPs are not counted, so prefill steps' floor is low.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class ModelBytes:
    """What one forward reads, by kind, for the model on rank 0 (TP=1: the whole model)."""
    expert: int          # one expert of one MoE layer (w13 + w2)
    num_experts: int
    top_k: int
    moe_layers: int
    dense: int           # read once a step whatever the batch
    embed_row: int       # read once per token (untied embeddings; tied: the head reads the table)
    kv_per_token: int    # K + V of one context token, all layers


def model_bytes(llm) -> ModelBytes:
    """From the engine's own parameters (shared tensors counted once)."""
    from engine.layers.moe import FusedMoE
    model, _ = llm.model_parts()
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    moes = [m for m in model.modules() if isinstance(m, FusedMoE)]
    expert_total = sum(m.w13.numel() * m.w13.element_size() + m.w2.numel() * m.w2.element_size()
                       for m in moes)
    num_experts = moes[0].num_experts if moes else 0
    embed = model.model.embed_tokens.weight
    tied = embed.data_ptr() == model.lm_head.weight.data_ptr()
    table = 0 if tied else embed.numel() * embed.element_size()
    return ModelBytes(expert=expert_total // max(1, num_experts * len(moes)),
                      num_experts=num_experts, top_k=moes[0].top_k if moes else 0,
                      moe_layers=len(moes), dense=total - expert_total - table,
                      embed_row=embed.shape[1] * embed.element_size(),
                      kv_per_token=llm.inspect().kv_layout.bytes_per_token)


def expected_experts(tokens: int, num_experts: int, top_k: int) -> float:
    """Distinct experts a layer reads for `tokens` tokens under uniform routing."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def step_tokens(step) -> int:
    return step.num_prefill_tokens + step.num_decode_tokens


def step_bytes(step, mb: ModelBytes, counted: bool) -> tuple[float, float, float]:
    """(expert, dense, KV) bytes step `step` (a StepTrace) must read. counted: the distinct
    experts from the step's expert load (which weighs graph padding rows 0)."""
    n = step_tokens(step)
    if counted and step.expert_load is not None:
        experts = float((np.asarray(step.expert_load) > 0).sum())       # over all MoE layers
    else:
        experts = mb.moe_layers * expected_experts(n, mb.num_experts, mb.top_k)
    context = sum(e.start_pos + e.num_tokens for e in step.entries)
    return experts * mb.expert, float(mb.dense + n * mb.embed_row), float(context * mb.kv_per_token)


def run_floor(steps, mb: ModelBytes, copy_bw: float, counted: bool = False) -> dict:
    """The floor of a run from its step traces: seconds, tok/s for `output_tokens`, and the
    bytes by kind. copy_bw in bytes/s."""
    parts = np.array([step_bytes(s, mb, counted) for s in steps]).reshape(-1, 3)
    expert, dense, kv = parts.sum(0)
    decode = [s for s in steps if s.num_prefill_tokens == 0]
    seconds = (expert + dense + kv) / copy_bw
    return dict(seconds=seconds, expert_bytes=expert, dense_bytes=dense, kv_bytes=kv,
                steps=len(steps), decode_steps=len(decode),
                mean_decode_batch=float(np.mean([step_tokens(s) for s in decode])) if decode else 0.0,
                experts_per_layer=(expert / mb.expert / mb.moe_layers / len(steps)
                                   if steps and mb.moe_layers else 0.0),
                counted=bool(counted and any(s.expert_load is not None for s in steps)))


def copy_bandwidth(floor_rows: list[dict], device: torch.device) -> float:
    """bytes/s: from measure_floors' rows when the run measured them, else measured now."""
    for r in floor_rows:
        if r.get("metric") == "copy_bandwidth" and r.get("value"):
            return r["value"] * 1e12
    from bench.common import measure_copy_bandwidth
    return measure_copy_bandwidth(device)
