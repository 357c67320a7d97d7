"""RMSNorm, plain and fused with the residual add, with HF Qwen3RMSNorm's rounding points.

The kernel already sums the squares of the residual stream it normalises; when a probe asks
(`sumsq`), it also stores that per-row sum, so residual norms cost no extra launch."""
import torch
import triton
import triton.language as tl

from .pdl import use_pdl, wait_prior


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr, sumsq_ptr,
    num_rows, hidden, inner, stride_xa, stride_xb, stride_r, stride_o, stride_ro, eps,
    HAS_RESIDUAL: tl.constexpr, WRITE_SUMSQ: tl.constexpr, BLOCK_ROWS: tl.constexpr,
    BLOCK_H: tl.constexpr, USE_PDL: tl.constexpr,
):
    wait_prior(USE_PDL)
    row_ids = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    rows = row_ids[:, None]
    cols = tl.arange(0, BLOCK_H)[None, :]
    mask = (rows < num_rows) & (cols < hidden)
    rows = rows.to(tl.int64)
    # x is [A, inner, H] with any row strides, so a q/k slice of the fused qkv output needs no copy
    x = tl.load(x_ptr + (rows // inner) * stride_xa + (rows % inner) * stride_xb + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + rows * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # HF adds in the model dtype
        tl.store(residual_out_ptr + rows * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    sq = tl.sum(xf * xf, axis=1)
    if WRITE_SUMSQ:  # probes: ||residual||^2 per row, from the sum the norm needs anyway
        tl.store(sumsq_ptr + row_ids, sq, mask=row_ids < num_rows)
    var = sq / hidden
    normed = (xf * tl.rsqrt(var + eps)[:, None]).to(x.dtype)  # HF rounds before the weight
    w = tl.load(weight_ptr + cols, mask=cols < hidden, other=0.0)
    out = normed.to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + rows * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def _launch(x, residual, weight, eps, sumsq=None, pdl=True):
    shape = x.shape
    hidden = shape[-1]
    x3 = x if x.dim() == 3 else x.reshape(-1, 1, hidden)  # [A, inner, H]
    if x3.stride(-1) != 1:
        x3 = x3.contiguous()
    out = torch.empty(shape, dtype=x.dtype, device=x.device)
    out2 = out.view(-1, hidden)
    if residual is not None:
        r2 = residual.reshape(-1, hidden)
        if r2.stride(-1) != 1:
            r2 = r2.contiguous()
        residual_out = torch.empty(shape, dtype=x.dtype, device=x.device)
        ro2 = residual_out.view(-1, hidden)
    else:
        r2 = ro2 = residual_out = out2  # unused placeholders
    num_rows = out2.shape[0]
    if num_rows == 0:
        return out, residual_out
    block_h = triton.next_power_of_2(hidden)
    # small rows (q/k norm over head_dim) pack several per program so each program moves >= ~4K elements
    block_rows = max(1, min(16, 4096 // block_h))
    num_warps = 8 if block_h >= 4096 else 4 if block_h * block_rows >= 1024 else 2
    grid = (triton.cdiv(num_rows, block_rows),)
    pdl = use_pdl(x, pdl)
    if sumsq is not None and (sumsq.dtype != torch.float32 or sumsq.stride(0) != 1
                              or sumsq.shape[0] < num_rows):
        raise ValueError(f"sumsq must be a contiguous fp32 buffer of >= {num_rows} rows")
    _rms_norm_kernel[grid](
        x3, r2, weight, out2, ro2, sumsq if sumsq is not None else out2, num_rows, hidden,
        x3.shape[1], x3.stride(0), x3.stride(1), r2.stride(0), out2.stride(0), ro2.stride(0), eps,
        HAS_RESIDUAL=residual is not None, WRITE_SUMSQ=sumsq is not None,
        BLOCK_ROWS=block_rows, BLOCK_H=block_h, USE_PDL=pdl, num_warps=num_warps, launch_pdl=pdl,
    )
    return out, residual_out


def rms_norm(
    x: torch.Tensor,       # [N, H] or [N, heads, H] (any row strides); normalised over the last dim
    weight: torch.Tensor,  # [H]
    eps: float,
    sumsq: torch.Tensor | None = None,  # [>= N] fp32: also store sum(x^2) per row (probes)
    pdl: bool = True,      # launch with PDL where the GPU has it (KernelConfig.pdl)
) -> torch.Tensor:         # [N, H], x.dtype
    return _launch(x, None, weight, eps, sumsq, pdl)[0]


def fused_add_rms_norm(
    x: torch.Tensor,         # [N, H]
    residual: torch.Tensor,  # [N, H]
    weight: torch.Tensor,    # [H]
    eps: float,
    sumsq: torch.Tensor | None = None,  # [>= N] fp32: also store sum((x + residual)^2) per row
    pdl: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:  # (rms_norm(x + residual), x + residual), both new tensors
    return _launch(x, residual, weight, eps, sumsq, pdl)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 sumsq: torch.Tensor | None = None) -> torch.Tensor:
    """Torch reference (and the CPU path), step for step as HF Qwen3RMSNorm.forward."""
    dtype = x.dtype
    xf = x.float()
    sq = xf.pow(2)
    if sumsq is not None:
        n = xf.reshape(-1, xf.shape[-1]).shape[0]
        sumsq[:n] = sq.reshape(n, -1).sum(-1)
    var = sq.mean(-1, keepdim=True)
    return (weight * (xf * torch.rsqrt(var + eps)).to(dtype)).to(dtype)


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
    sumsq: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    residual_out = x + residual
    return rms_norm_ref(residual_out, weight, eps, sumsq), residual_out
