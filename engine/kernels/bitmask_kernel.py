"""A grammar's token bitmask applied to a step's logits in one launch (structured output), where
the torch version (engine/guided.apply_bitmask, the reference and the CPU path) takes three
[B, V] passes and four launches. Each program reads a chunk of a row's logits and the 32-bit
words covering it. Ids past the mask's width (a vocabulary padded beyond the tokenizer's) are
forbidden.
"""
import torch
import triton
import triton.language as tl


@triton.jit
def _bitmask_kernel(logits_ptr, mask_ptr, out_ptr, vocab, num_words, stride_l, stride_m,
                    stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    ids = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = ids < vocab
    x = tl.load(logits_ptr + row.to(tl.int64) * stride_l + ids, mask=in_vocab, other=0.0)
    word_at = ids // 32
    words = tl.load(mask_ptr + row.to(tl.int64) * stride_m + word_at,
                    mask=in_vocab & (word_at < num_words), other=0)
    allowed = ((words >> (ids % 32)) & 1) != 0    # arithmetic shift: & 1 keeps bit 31 right
    tl.store(out_ptr + row.to(tl.int64) * stride_o + ids,
             tl.where(allowed, x, float("-inf")).to(out_ptr.dtype.element_ty), mask=in_vocab)


def apply_bitmask_kernel(logits: torch.Tensor, mask: torch.Tensor,
                         block: int = 1024) -> torch.Tensor:
    """logits [B, V], mask [B, W] int32 (bit t of row r = token t allowed) -> a new [B, V]
    tensor of logits' dtype with the forbidden tokens at -inf."""
    B, V = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    mask = mask.contiguous()
    out = torch.empty_like(logits)
    if B == 0:
        return out
    _bitmask_kernel[(B, triton.cdiv(V, block))](
        logits, mask, out, V, mask.shape[1], logits.stride(0), mask.stride(0), out.stride(0),
        BLOCK=block, num_warps=4)
    return out
