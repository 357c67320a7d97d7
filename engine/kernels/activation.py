"""SwiGLU gate: silu(gate) * up over the merged gate_up projection, one read and one write."""
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .pdl import use_pdl, wait_prior


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, inter, stride_x, stride_o, BLOCK: tl.constexpr,
                         USE_PDL: tl.constexpr):
    wait_prior(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)  # HF rounds silu to the model dtype before the product
    out = act.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, out.to(gate.dtype), mask=mask)


def silu_and_mul(x: torch.Tensor, pdl: bool = True) -> torch.Tensor:  # [N, 2I] -> [N, I]
    num_rows, two_inter = x.shape
    inter = two_inter // 2
    out = torch.empty(num_rows, inter, dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return out
    if x.stride(-1) != 1:
        x = x.contiguous()
    block = min(1024, triton.next_power_of_2(inter))
    pdl = use_pdl(x, pdl)
    _silu_and_mul_kernel[(num_rows, triton.cdiv(inter, block))](
        x, out, inter, x.stride(0), out.stride(0), BLOCK=block, USE_PDL=pdl, num_warps=4,
        launch_pdl=pdl,
    )
    return out


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """Torch reference (and the CPU path), as HF Qwen's MLP computes it."""
    inter = x.shape[-1] // 2
    return F.silu(x[..., :inter]) * x[..., inter:]
