"""MoE experts in torch with each token's output independent of the other tokens of the step: the
engine's CPU path.

The HF-order reference (fused_moe.fused_moe_ref) runs one GEMM per expert; a BLAS GEMM's result
for a row depends on the GEMM's row count and the row's place in it, which change with other
requests' routing (an untouched request's logprobs moved in the last bits). Here every
(token, k) pair is its own M = 1 product (one bmm per expert, the weight broadcast), and a
token's k outputs are summed in its top-k slot order, as the GPU kernels do. Not HF's summation
order (it sums experts ascending), so equal to HF to rounding, not in bits.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels.fused_moe import check_shapes, expert_runs


def _rows_times(a: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """a [P, 1, K], weight [N, K] -> [P, 1, N], each row an M = 1 product of its own."""
    return torch.bmm(a, weight.t().unsqueeze(0).expand(a.shape[0], -1, -1))


def fused_moe_cpu(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """fused_moe's contract, summed j = 0..k-1; the weights are cast to x.dtype first, as HF
    casts them. One host sync (the per-expert counts): for the CPU, not for CUDA graphs."""
    check_shapes(x, w13, w2, topk_weights, topk_ids)
    num_tokens, top_k = topk_ids.shape
    if num_tokens == 0:
        return torch.zeros_like(x)
    flat = topk_ids.reshape(-1).long()                      # [N*k], flat index = token * k + j
    weights = topk_weights.reshape(-1).to(x.dtype)
    y = torch.empty(flat.numel(), x.shape[1], dtype=x.dtype, device=x.device)  # [N*k, H]
    for e, pairs in expert_runs(flat, w13.shape[0]):
        gate, up = _rows_times(x[pairs // top_k].unsqueeze(1), w13[e]).chunk(2, dim=-1)
        h = _rows_times(F.silu(gate) * up, w2[e]).squeeze(1)  # [count, H]
        y[pairs] = h * weights[pairs, None]
    y = y.view(num_tokens, top_k, -1)
    out = y[:, 0].clone()
    for j in range(1, top_k):   # elementwise adds in slot order: no reduction kernel's blocking
        out += y[:, j]
    return out
