"""MoE experts in torch with each token's output independent of the other tokens of the step: the
engine's CPU path.

The HF-order reference (fused_moe.fused_moe_ref) runs one GEMM per expert over the rows routed
to it. A BLAS GEMM's result for a row depends on the GEMM's row count and on the row's place in it
(MKL's sgemm: M = 1 is a GEMV, and rows of a full register panel and rows of the remainder are
summed in different orders), and both change when another request's routing changes, so an
untouched request's logprobs moved in the last bits beside a request with masked experts. Here:

  * every (token, k) pair's product with its expert is its own M = 1 product: one bmm per expert
    over [pairs, 1, H] with the expert's weight broadcast (no copy); a batched GEMM computes each
    item alone, so a row's bits depend only on that row and the weights;
  * a token's k weighted outputs are summed in its own top-k slot order (j = 0..k-1, as the GPU
    kernels do), never across tokens.

Not HF's summation order (it sums experts ascending), so equal to HF to rounding, not in bits.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels.fused_moe import check_shapes, expert_runs


def _rows_times(a: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """a [P, 1, K], weight [N, K] -> [P, 1, N], each row an M = 1 product of its own."""
    return torch.bmm(a, weight.t().unsqueeze(0).expand(a.shape[0], -1, -1))


def fused_moe_cpu(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """out[t] = sum_j topk_weights[t, j] * W2_e (silu(G_e x_t) * (U_e x_t)), e = topk_ids[t, j],
    summed j = 0..k-1. x [N, H]; w13 [E, 2I, H] (gate rows, then up rows); w2 [E, H, I];
    topk_* [N, k]. The weights are cast to x.dtype first, as HF casts them. One host sync (the
    per-expert counts): for the CPU, not for CUDA graphs."""
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
