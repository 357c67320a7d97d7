"""Fused temperature sampling: per row, argmax_v logits[v] / T - log(-log u[v]) (greedy argmax where
T == 0), with u[v] the same counter-based uniform as engine.sampling_noise.uniform_noise.

The Gumbel argmax is the torch sampler's exponential race argmax p / E (E = -log u) in log
space: the same draw without softmax or [B, V] int64 hash tensors, in one read of the logits
over a (B, chunks) grid; a second launch reduces each row's chunk winners.
"""
import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from engine.kernels.jit_keys import varying
from engine.sampling_noise import uniform_noise

# splitmix64 constants as unsigned tl.constexpr objects, which a kernel may read as globals
_GOLDEN = tl.constexpr(0x9E3779B97F4A7C15)
_MUL1 = tl.constexpr(0xBF58476D1CE4E5B9)
_MUL2 = tl.constexpr(0x94D049BB133111EB)


@triton.jit
def _mix64(x):
    """splitmix64 finaliser on uint64: multiplies wrap and >> is a logical shift, which the torch
    version has to emulate on int64 with masks."""
    x ^= x >> 30
    x *= _MUL1
    x ^= x >> 27
    x *= _MUL2
    return x ^ (x >> 31)


@triton.jit
def _uniform(seed, position, ids):
    """fp32 uniforms for int32 token ids (>= 0) of one row (int64 seed, position), bit for bit
    uniform_noise's: the top 23 hash bits + 0.5, times 2**-23 — exact in fp32 and strictly
    inside (0, 1), so no token ever gets E = -log u = 0 (an unconditional win)."""
    key = _mix64(seed.to(tl.uint64, bitcast=True) * _GOLDEN + position.to(tl.uint64, bitcast=True))
    bits = _mix64(key + ids.to(tl.uint64) * _GOLDEN)
    top = (bits >> 41).to(tl.int32)   # < 2**23: top + 0.5 is exact in fp32
    return (top.to(tl.float32) + 0.5) * (1.0 / 8388608.0)


@triton.jit(do_not_specialize=varying("temp_ptr", "seed_ptr", "pos_ptr"))
def _partial_kernel(logits_ptr, stride_row, temp_ptr, seed_ptr, pos_ptr, val_ptr, idx_ptr,
                    vocab, num_chunks, BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    ids = chunk * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(logits_ptr + row.to(tl.int64) * stride_row + ids, mask=ids < vocab,
                other=float("-inf")).to(tl.float32)
    temp = tl.load(temp_ptr + row)
    if temp == 0.0:       # greedy row: no noise to compute
        score = x
    else:
        u = _uniform(tl.load(seed_ptr + row), tl.load(pos_ptr + row), ids)
        # bit for bit torch's arithmetic, so near-ties resolve as in the reference: `/` compiles to
        # an approximate division (a third of the quotients an ulp off on an H200), div_rn is
        # IEEE; libdevice.log is the logf torch's log calls (tl.log's lowering is not promised)
        if LIBDEVICE:
            score = tl.math.div_rn(x, temp) - libdevice.log(-libdevice.log(u))
        else:             # the interpreter: numpy's log, and no extern calls
            score = tl.math.div_rn(x, temp) - tl.log(-tl.log(u))
    # NaN (a banned -inf logit meeting u == 1, or a NaN logit) never wins; -inf padding lanes
    # only win an all -inf row, where the lowest id, a real token, is taken as torch does.
    # Ties go to the lowest id, as torch.argmax's
    score = tl.where(score != score, float("-inf"), score)
    best, at = tl.max(score, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(val_ptr + row * num_chunks + chunk, best)
    tl.store(idx_ptr + row * num_chunks + chunk, chunk * BLOCK + at)


@triton.jit
def _reduce_kernel(val_ptr, idx_ptr, out_ptr, num_chunks, BLOCK_C: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_C)
    v = tl.load(val_ptr + row * num_chunks + offs, mask=offs < num_chunks, other=float("-inf"))
    # chunk winners are in id order, so the first chunk holding the maximum has the lowest id
    _, c = tl.max(v, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(out_ptr + row, tl.load(idx_ptr + row * num_chunks + c).to(tl.int64))


def gumbel_argmax(
    logits: torch.Tensor,        # [B, V] fp32 / bf16 / fp16, any row stride
    temperature: torch.Tensor,   # [B] fp32, 0 = greedy
    seeds: torch.Tensor,         # [B] int64
    positions: torch.Tensor,     # [B] int64
    block: int | None = None,    # vocabulary chunk per program (a power of two); None: by batch
) -> torch.Tensor:               # [B] int64 token ids
    B, V = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    if block is None:
        # measured on an H200 at V = 151936 (graph replay): 512 best up to B = 4, where one row
        # must spread over the SMs; 1024 from B = 8 up (~2% ahead of 2048, ~5% of 4096 at B = 256)
        block = 512 if B <= 4 else 1024
    num_chunks = triton.cdiv(V, block)
    dev = logits.device
    out = torch.empty(B, dtype=torch.int64, device=dev)
    if B == 0:
        return out
    vals = torch.empty(B, num_chunks, dtype=torch.float32, device=dev)
    idxs = torch.empty(B, num_chunks, dtype=torch.int32, device=dev)
    temperature = temperature.to(torch.float32).contiguous()
    seeds = seeds.to(torch.int64).contiguous()
    positions = positions.to(torch.int64).contiguous()
    _partial_kernel[(B, num_chunks)](
        logits, logits.stride(0), temperature, seeds, positions, vals, idxs, V, num_chunks,
        BLOCK=block, LIBDEVICE=not _INTERPRETED, num_warps=4 if block <= 2048 else 8)
    _reduce_kernel[(B,)](vals, idxs, out, num_chunks,
                         BLOCK_C=max(16, triton.next_power_of_2(num_chunks)), num_warps=1)
    return out


def gumbel_argmax_ref(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor,
                      positions: torch.Tensor) -> torch.Tensor:
    """Torch reference: the same formula over uniform_noise's [B, V] uniforms."""
    x = logits.float()
    t = temperature.float()[:, None]
    u = uniform_noise(seeds, positions, x.shape[-1])
    score = torch.where(t == 0, x, x / t - torch.log(-torch.log(u)))
    score = score.masked_fill(score.isnan(), float("-inf"))
    return score.argmax(dim=-1)


def uniform_debug(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, vocab] fp32 uniforms from the kernel's own hash helpers (for tests against uniform_noise)."""
    B = seeds.shape[0]
    out = torch.empty(B, vocab, dtype=torch.float32, device=seeds.device)
    block = 1024
    _uniform_debug_kernel[(B, triton.cdiv(vocab, block))](
        seeds.to(torch.int64).contiguous(), positions.to(torch.int64).contiguous(), out, vocab,
        BLOCK=block)
    return out


@triton.jit
def _uniform_debug_kernel(seed_ptr, pos_ptr, out_ptr, vocab, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    ids = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    u = _uniform(tl.load(seed_ptr + row), tl.load(pos_ptr + row), ids)
    tl.store(out_ptr + row.to(tl.int64) * vocab + ids, u, mask=ids < vocab)


# @triton.jit returns an interpreter stand-in when TRITON_INTERPRET was set at import: extern
# libdevice calls do not exist there
_INTERPRETED = not isinstance(_partial_kernel, triton.runtime.jit.JITFunction)
