"""Group (token, k) pairs by expert into block_m-padded runs, so a grouped GEMM sees one expert per block."""

import os

import torch
import triton
import triton.language as tl

from engine.kernels.jit_keys import varying


def align_sizes(num_pairs: int, num_experts: int, block_m: int) -> tuple[int, int]:
    """Static sizes: (len(sorted_token_ids), len(expert_ids)) — worst case, every expert padded."""
    max_padded = num_pairs + num_experts * (block_m - 1)
    return max_padded, triton.cdiv(max_padded, block_m)


def max_used_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Static upper bound on non-empty blocks: each expert with tokens adds at most one partial block."""
    return min(align_sizes(num_pairs, num_experts, block_m)[1], num_pairs // block_m + min(num_experts, num_pairs))


# The kernels build a [SUB, E_P2] one-hot of a slice of pairs: its column sums are per-expert
# counts and its running column sums give each pair's rank among the pairs of its expert.


@triton.jit
def _count_pairs(topk_ids_ptr, start, length, num_pairs, SUB: tl.constexpr, E_P2: tl.constexpr):
    experts = tl.arange(0, E_P2)
    counts = tl.zeros([E_P2], dtype=tl.int32)
    for s in range(0, length, SUB):
        offs = start + s + tl.arange(0, SUB)
        ids = tl.load(topk_ids_ptr + offs, mask=offs < num_pairs, other=E_P2).to(tl.int32)  # E_P2 matches no expert
        counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
    return counts


@triton.jit
def _place_pairs(topk_ids_ptr, sorted_ptr, start, length, num_pairs, next_slot,
                 SUB: tl.constexpr, E_P2: tl.constexpr):
    # next_slot[e]: where this slice's first pair of expert e goes in sorted_token_ids
    experts = tl.arange(0, E_P2)
    for s in range(0, length, SUB):
        offs = start + s + tl.arange(0, SUB)
        valid = offs < num_pairs
        ids = tl.load(topk_ids_ptr + offs, mask=valid, other=E_P2).to(tl.int32)
        onehot = (ids[:, None] == experts[None, :]).to(tl.int32)  # [SUB, E_P2]
        rank = tl.sum(tl.cumsum(onehot, axis=0) * onehot, axis=1) - 1
        slot = tl.sum(onehot * next_slot[None, :], axis=1) + rank
        tl.store(sorted_ptr + slot, offs, mask=valid)
        next_slot += tl.sum(onehot, axis=0)


@triton.jit
def _padded_runs(counts, BLOCK_M: tl.constexpr):
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, axis=0)
    return padded_end - padded, padded_end, tl.sum(padded, axis=0)


@triton.jit
def _write_expert_ids(expert_ids_ptr, padded_end, total, used_blocks, num_blocks,
                      BLOCK_M: tl.constexpr, BCH: tl.constexpr):
    offs = tl.arange(0, BCH)
    for b0 in range(0, used_blocks, BCH):
        blocks = b0 + offs
        block_start = blocks * BLOCK_M
        # expert of a block = number of experts whose padded run ends at or before its start
        expert = tl.sum((padded_end[None, :] <= block_start[:, None]).to(tl.int32), axis=1)
        expert = tl.where(block_start < total, expert, -1)
        tl.store(expert_ids_ptr + blocks, expert, mask=blocks < used_blocks)
    for b0 in range(used_blocks, num_blocks, BCH):  # past the static bound: never used
        tl.store(expert_ids_ptr + b0 + offs, tl.full([BCH], -1, tl.int32), mask=b0 + offs < num_blocks)


@triton.jit
def _fill_sentinel(sorted_ptr, start, end, sentinel, FILL: tl.constexpr):
    offs = tl.arange(0, FILL)
    for f in range(start, end, FILL):
        tl.store(sorted_ptr + f + offs, tl.full([FILL], 0, tl.int32) + sentinel, mask=f + offs < end)


@triton.jit(do_not_specialize=varying(
    "topk_ids_ptr", "num_pairs", "max_padded", "used_blocks", "num_blocks"))
def _align_single_kernel(
    topk_ids_ptr, sorted_ptr, expert_ids_ptr, ntpp_ptr,
    num_pairs, max_padded, used_blocks, num_blocks,
    BLOCK_M: tl.constexpr, E_P2: tl.constexpr, SUB: tl.constexpr, FILL: tl.constexpr, BCH: tl.constexpr,
):
    # Decode sizes: one launch does it all; no cross-program prefix sum needed.
    counts = _count_pairs(topk_ids_ptr, 0, num_pairs, num_pairs, SUB, E_P2)
    padded_start, padded_end, total = _padded_runs(counts, BLOCK_M)
    tl.store(ntpp_ptr, total)
    _fill_sentinel(sorted_ptr, 0, max_padded, num_pairs, FILL)
    tl.debug_barrier()  # the scatter overwrites some sentinels: every thread's fill must land first
    _place_pairs(topk_ids_ptr, sorted_ptr, 0, num_pairs, num_pairs, padded_start, SUB, E_P2)
    _write_expert_ids(expert_ids_ptr, padded_end, total, used_blocks, num_blocks, BLOCK_M, BCH)


@triton.jit(do_not_specialize=varying("topk_ids_ptr", "num_pairs", "max_padded", "fill_len"))
def _align_count_kernel(topk_ids_ptr, sorted_ptr, chunk_ptr, num_pairs, max_padded, fill_len,
                        CHUNK: tl.constexpr, SUB: tl.constexpr, E_P2: tl.constexpr, FILL: tl.constexpr):
    # Larger batches, stage 1 of 3: per-chunk expert counts; the sentinel fill rides along.
    pid = tl.program_id(0)
    counts = _count_pairs(topk_ids_ptr, pid * CHUNK, CHUNK, num_pairs, SUB, E_P2)
    tl.store(chunk_ptr + pid * E_P2 + tl.arange(0, E_P2), counts)
    _fill_sentinel(sorted_ptr, pid * fill_len, tl.minimum(pid * fill_len + fill_len, max_padded), num_pairs, FILL)


@triton.jit(do_not_specialize=varying("num_chunks", "used_blocks", "num_blocks"))
def _align_scan_kernel(chunk_ptr, expert_ids_ptr, ntpp_ptr, num_chunks, used_blocks, num_blocks,
                       BLOCK_M: tl.constexpr, E_P2: tl.constexpr, NC_P2: tl.constexpr, BCH: tl.constexpr):
    # Stage 2: one program turns chunk counts into each chunk's first slot per expert (in place).
    rows = tl.arange(0, NC_P2)
    experts = tl.arange(0, E_P2)
    ptrs = chunk_ptr + rows[:, None] * E_P2 + experts[None, :]
    c = tl.load(ptrs, mask=rows[:, None] < num_chunks, other=0)  # [NC_P2, E_P2]
    padded_start, padded_end, total = _padded_runs(tl.sum(c, axis=0), BLOCK_M)
    tl.store(ntpp_ptr, total)
    tl.store(ptrs, padded_start[None, :] + tl.cumsum(c, axis=0) - c, mask=rows[:, None] < num_chunks)
    _write_expert_ids(expert_ids_ptr, padded_end, total, used_blocks, num_blocks, BLOCK_M, BCH)


@triton.jit(do_not_specialize=varying("topk_ids_ptr", "num_pairs"))
def _align_place_kernel(topk_ids_ptr, sorted_ptr, chunk_ptr, num_pairs,
                        CHUNK: tl.constexpr, SUB: tl.constexpr, E_P2: tl.constexpr):
    # Stage 3: every chunk scatters its pairs from its own first slots.
    pid = tl.program_id(0)
    next_slot = tl.load(chunk_ptr + pid * E_P2 + tl.arange(0, E_P2))
    _place_pairs(topk_ids_ptr, sorted_ptr, pid * CHUNK, CHUNK, num_pairs, next_slot, SUB, E_P2)


def _moe_align_triton(topk_ids: torch.Tensor, num_experts: int, block_m: int,
                      sub: int | None = None, max_chunks: int | None = None):
    """Single-launch path for at most `sub` pairs, else count / scan / place over chunks.
    `sub` and `max_chunks` override the slice and chunk-count sizing (tests use them)."""
    flat = topk_ids.reshape(-1)
    num_pairs = flat.numel()
    max_padded, num_blocks = align_sizes(num_pairs, num_experts, block_m)
    used_blocks = max_used_blocks(num_pairs, num_experts, block_m)
    dev = topk_ids.device
    sorted_token_ids = torch.empty(max_padded, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(num_blocks, dtype=torch.int32, device=dev)
    ntpp = torch.empty(1, dtype=torch.int32, device=dev)
    e_p2 = triton.next_power_of_2(num_experts)
    sub = sub or max(16, 8192 // e_p2)  # pairs per one-hot slice
    bch = max(16, 4096 // e_p2)
    if num_pairs <= sub:
        _align_single_kernel[(1,)](
            flat, sorted_token_ids, expert_ids, ntpp, num_pairs, max_padded, used_blocks, num_blocks,
            BLOCK_M=block_m, E_P2=e_p2, SUB=sub, FILL=1024, BCH=bch, num_warps=4,
        )
        return sorted_token_ids, expert_ids, ntpp
    # few enough chunks that stage 2's [chunks, E_P2] tile fits one program
    max_chunks = max_chunks or max(2, 16384 // e_p2)
    chunk = sub * triton.cdiv(num_pairs, max_chunks * sub)
    num_chunks = triton.cdiv(num_pairs, chunk)
    chunk_buf = torch.empty(num_chunks, e_p2, dtype=torch.int32, device=dev)  # counts, then first slots
    fill_len = triton.cdiv(max_padded, num_chunks)
    _align_count_kernel[(num_chunks,)](
        flat, sorted_token_ids, chunk_buf, num_pairs, max_padded, fill_len,
        CHUNK=chunk, SUB=sub, E_P2=e_p2, FILL=1024, num_warps=4,
    )
    _align_scan_kernel[(1,)](
        chunk_buf, expert_ids, ntpp, num_chunks, used_blocks, num_blocks,
        BLOCK_M=block_m, E_P2=e_p2, NC_P2=triton.next_power_of_2(num_chunks), BCH=bch, num_warps=8,
    )
    _align_place_kernel[(num_chunks,)](
        flat, sorted_token_ids, chunk_buf, num_pairs, CHUNK=chunk, SUB=sub, E_P2=e_p2, num_warps=4,
    )
    return sorted_token_ids, expert_ids, ntpp


def _moe_align_torch(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """Vectorised and graph-safe (fixed shapes, no host sync): stable sort + prefix sums."""
    flat = topk_ids.reshape(-1).long()  # [num_pairs]
    num_pairs = flat.numel()
    max_padded, num_blocks = align_sizes(num_pairs, num_experts, block_m)
    dev = flat.device
    # scatter_add rather than bincount: CUDA bincount syncs to find the max.
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)  # [E]
    padded_start = padded_end - padded
    count_start = torch.cumsum(counts, 0) - counts
    sorted_experts, order = torch.sort(flat, stable=True)
    rank = torch.arange(num_pairs, device=dev) - count_start[sorted_experts]
    sorted_token_ids = torch.full((max_padded,), num_pairs, dtype=torch.int32, device=dev)
    sorted_token_ids.scatter_(0, padded_start[sorted_experts] + rank, order.to(torch.int32))
    block_start = torch.arange(num_blocks, device=dev) * block_m
    total = padded_end[-1:]
    expert_ids = torch.searchsorted(padded_end, block_start, right=True)
    expert_ids = torch.where(block_start < total, expert_ids, -1).to(torch.int32)
    return sorted_token_ids, expert_ids, total.to(torch.int32)


def moe_align(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort (token, k) pairs by expert, padding each expert's run to a multiple of block_m.

    topk_ids: [num_tokens, top_k] int. Returns
      sorted_token_ids [num_pairs + E*(block_m-1)] int32: flat indices into topk_ids.flatten(),
        grouped by expert (ascending flat index within an expert), sentinel num_pairs in padding;
      expert_ids [cdiv(len(sorted_token_ids), block_m)] int32: expert of each block, -1 if unused;
      num_tokens_post_padded [1] int32.
    Shapes depend only on (num_tokens, top_k, E, block_m), so this is CUDA-graph safe.
    """
    if block_m < 1 or num_experts < 1:
        raise ValueError(f"block_m and num_experts must be >= 1, got {block_m} and {num_experts}")
    # Triton on CUDA (and in the interpreter, where fused_moe's kernels run on the CPU too)
    on_triton = topk_ids.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"
    if on_triton and topk_ids.numel() > 0:
        return _moe_align_triton(topk_ids, num_experts, block_m)
    return _moe_align_torch(topk_ids, num_experts, block_m)


def moe_align_ref(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plain-torch reference with a loop over experts (host syncs; tests only)."""
    flat = topk_ids.reshape(-1).long()
    num_pairs = flat.numel()
    max_padded, num_blocks = align_sizes(num_pairs, num_experts, block_m)
    sorted_token_ids = torch.full((max_padded,), num_pairs, dtype=torch.int32)
    expert_ids = torch.full((num_blocks,), -1, dtype=torch.int32)
    pos = 0
    for e in range(num_experts):
        idx = torch.nonzero(flat.cpu() == e).flatten()
        if idx.numel() == 0:
            continue
        sorted_token_ids[pos:pos + idx.numel()] = idx.to(torch.int32)
        nblk = -(-idx.numel() // block_m)
        expert_ids[pos // block_m: pos // block_m + nblk] = e
        pos += nblk * block_m
    dev = topk_ids.device
    return sorted_token_ids.to(dev), expert_ids.to(dev), torch.tensor([pos], dtype=torch.int32, device=dev)
