"""Presence / frequency / repetition penalties in one pass over the penalised rows' logits, read
from the persistent per-request count rows (engine/penalties.py), written in place.

Per penalised row p (batch row rows[p], count row slots[p]) and token v:
    c = counts[slot, v]; seen = prompt_seen[slot, v] or c > 0
    x = seen ? (x > 0 ? x / rep : x * rep) : x          (HF's repetition processor)
    x = x - frequency * c - presence * (c > 0)           (OpenAI's penalties)
The torch form reads and writes [P, V] tensors about a dozen times; the kernel reads each
operand once (H200, V = 151936, P = 256: a few percent of a decode step -> under one).
"""
import torch
import triton
import triton.language as tl


@triton.jit
def _penalties_kernel(logits_ptr, stride_row, rows_ptr, slots_ptr, counts_ptr, seen_ptr,
                      presence_ptr, frequency_ptr, repetition_ptr, vocab,
                      BLOCK: tl.constexpr):
    p = tl.program_id(0)
    ids = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = ids < vocab
    row = tl.load(rows_ptr + p)
    slot = tl.load(slots_ptr + p)
    ptr = logits_ptr + row * stride_row + ids
    x = tl.load(ptr, mask=live, other=0.0)
    c = tl.load(counts_ptr + slot * vocab + ids, mask=live, other=0)
    seen = (tl.load(seen_ptr + slot * vocab + ids, mask=live, other=0) != 0) | (c > 0)
    rep = tl.load(repetition_ptr + p)
    # div_rn: IEEE division, as torch's (the default `/` is approximate on a GPU)
    x = tl.where(seen, tl.where(x > 0, tl.math.div_rn(x, rep), x * rep), x)
    cf = c.to(tl.float32)
    x = x - tl.load(frequency_ptr + p) * cf - tl.load(presence_ptr + p) * (c > 0).to(tl.float32)
    tl.store(ptr, x, mask=live)


def apply_count_penalties(
    logits: torch.Tensor,       # [B, V] fp32, written in place (rows not in `rows` untouched)
    rows: torch.Tensor,         # [P] int64 batch rows with a count penalty
    slots: torch.Tensor,        # [P] int64 their count rows
    counts: torch.Tensor,       # [S, V] int32 output-token counts per count row
    seen: torch.Tensor,         # [S, V] bool prompt tokens per count row
    presence: torch.Tensor,     # [P] fp32
    frequency: torch.Tensor,    # [P] fp32
    repetition: torch.Tensor,   # [P] fp32
    block: int = 1024,
) -> torch.Tensor:
    P = rows.shape[0]
    V = logits.shape[-1]
    if P == 0:
        return logits
    if logits.stride(-1) != 1 or counts.shape[-1] != V:
        raise ValueError(f"penalties need contiguous [B, {counts.shape[-1]}] logits, got "
                         f"{tuple(logits.shape)} with strides {logits.stride()}")
    _penalties_kernel[(P, triton.cdiv(V, block))](
        logits, logits.stride(0), rows, slots, counts, seen.view(torch.uint8), presence,
        frequency, repetition, V, BLOCK=block, num_warps=4)
    return logits


def apply_count_penalties_ref(logits, rows, slots, counts, seen, presence, frequency,
                              repetition) -> torch.Tensor:
    """Torch reference (and the CPU path): the same formula on gathered [P, V] rows."""
    if rows.shape[0] == 0:
        return logits
    x = logits.index_select(0, rows)
    c = counts.index_select(0, slots)
    in_output = c > 0
    seen_any = seen.index_select(0, slots) | in_output
    rep = repetition[:, None]
    x = torch.where(seen_any, torch.where(x > 0, x / rep, x * rep), x)
    x = x - frequency[:, None] * c.float() - presence[:, None] * in_output.float()
    return logits.index_copy_(0, rows, x)
