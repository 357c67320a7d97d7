"""Paged decode attention: one new query per sequence against its paged KV, split-KV + GQA packing.

Flash-decoding over a (batch, kv_head, split) grid: a program holds every query head of one KV
head (padded to 16 rows for tl.dot) and writes a partial output plus its log-sum-exp; the split
that finishes last merges them, with no second launch. The split count depends on shapes only,
so a call can be captured in a CUDA graph; each split takes an equal share, in whole tiles, of
the *runtime* context. Scratch lives in a module-level cache keyed by shape, allocated on first
use (during graph capture too) and shared by every layer: calls sharing a key must run on one
stream, one after another.
"""
import functools
import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .pdl import use_pdl, wait_prior

MAX_SPLITS = 32
# Launch parameters of the direct path (one program per sequence and KV head walks the whole
# context) and the split path, swept by bench/diagnostics/attention_tune.py. Three stages and
# 128-token tiles from WIDE_FROM_PROGRAMS: 4-10 % faster at batch 64-256 and 1,024 tokens (one
# H200, Qwen3-0.6B, 2026-12-03: bench/results/2026-12-03-attention-tune-*.txt).
DIRECT_LAUNCH = dict(BLOCK_N=64, num_warps=4, num_stages=3)
DIRECT_WIDE_BLOCK_N = 128       # the direct path's tile from WIDE_FROM_PROGRAMS on
SPLIT_LAUNCH = dict(BLOCK_N=32, num_warps=4, num_stages=2)
WAVES = 2           # choose_num_splits: programs for about this many waves of the GPU's SMs
# From this many programs (batch x KV heads) on, one wave instead of WAVES and 128-token tiles
# (splits of >= 512 tokens of the bound). One H200, contexts 512-1,536: Qwen3-30B-A3B batch
# 32 / 64 / 128, 32.5 / 49.5 / 90.1 -> 22.5 / 40.3 / 77.7 us a call (2026-12-04).
WIDE_FROM_PROGRAMS = 128
SPLIT_WIDE_LAUNCH = dict(BLOCK_N=128, num_warps=4, num_stages=3)
# Long contexts below WIDE_FROM_PROGRAMS: splits of at most LONG_SPLIT_TOKENS tokens, and
# 128-token tiles from SPLIT_WIDE_MIN_TOKENS a split. One H100, Qwen3-0.6B, batch 1 at 8,192 /
# 30,720 tokens: 12.0 / 34.3 -> 10.3 / 28.7 us a layer (bench/RESULTS.md "Long contexts").
LONG_SPLIT_TOKENS = 512
SPLIT_WIDE_MIN_TOKENS = 256     # context bound per split from which a split takes SPLIT_WIDE_LAUNCH
MIN_SPLIT_TOKENS = 32           # a split holds at least one split tile
MERGE_CHUNK_ELEMS = 8192    # fp32 partials a merge chunk holds (64 a thread at 4 warps)
_WORKSPACES: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


@functools.lru_cache(maxsize=None)
def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 8  # interpreter/CPU: any small value keeps the split path exercised
    return torch.cuda.get_device_properties(device).multi_processor_count


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 engines want fp32 attention; tf32 would cost ~3 decimal digits
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
    out_ptr, part_out_ptr, part_lse_ptr, counters_ptr, start_ptr,
    scale_log2, num_splits,
    stride_qb, stride_qh, stride_cb, stride_cs, stride_ch, stride_bt, stride_ob, stride_oh,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, DIRECT: tl.constexpr,
    BLOCK_S: tl.constexpr, DOT_PREC: tl.constexpr, USE_PDL: tl.constexpr,
    MERGE_G: tl.constexpr = 2, CHUNK_S: tl.constexpr = 1, EXTRA: tl.constexpr = 0,
):
    # EXTRA > 0 (cascade_attention.py): each row's keys start at start_ptr[b], and the merge
    # folds in the prefix kernel's partials from the workspace's first EXTRA split slots.
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    if EXTRA > 0:
        first = tl.load(start_ptr + b)
    else:
        first = 0
    # Before the PDL wait (pdl.py) this program reads only what was final before the kernel it
    # waits on started: the context length, the block table and its first tile's K/V, except
    # the newest token's, which that kernel (the K/V store) is writing: read after the wait.
    ctx = tl.load(context_lens_ptr + b)
    # this split's share of the runtime context, in whole tiles
    tiles = tl.cdiv(ctx - first, BLOCK_N)
    tiles_per_split = tl.cdiv(tiles, num_splits)
    start = first + split * tiles_per_split * BLOCK_N
    end = tl.minimum(start + tiles_per_split * BLOCK_N, ctx)
    # The split count is fixed by shapes (graphs), but a short context fills only the first few
    # splits: the rest exit here, before the wait, and the merge reads only the used ones (one
    # when the context is empty: it writes the zeros). One H200, batch 1 at 256 tokens (8 of 32
    # splits used): 780 -> 740 us a step (bench/results/2026-12-03c-*).
    n_used = tl.maximum(tl.cdiv(tiles, tl.maximum(tiles_per_split, 1)), 1)
    if split < n_used:
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, BLOCK_D)
        heads = kvh * GROUP + g
        row_mask = g < GROUP
        d_mask = d < HEAD_DIM
        bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt
        t = start + tl.arange(0, BLOCK_N)
        valid = t < end  # none: an empty split
        block = tl.load(bt_row + t // PAGE_SIZE, mask=valid, other=0).to(tl.int64)
        kv_off = block * stride_cb + (t % PAGE_SIZE) * stride_cs + kvh * stride_ch  # [BLOCK_N]
        old = (valid & (t < ctx - 1))[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + kv_off[:, None] + d[None, :], mask=old, other=0.0)
        v = tl.load(v_cache_ptr + kv_off[:, None] + d[None, :], mask=old, other=0.0)
        wait_prior(USE_PDL)
        q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                    mask=row_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_G, BLOCK_D]
        newest = (valid & (t == ctx - 1))[:, None] & d_mask[None, :]  # this step's token, if here
        k = tl.load(k_cache_ptr + kv_off[:, None] + d[None, :], mask=newest, other=k)
        v = tl.load(v_cache_ptr + kv_off[:, None] + d[None, :], mask=newest, other=v)

        # the first tile, peeled off the loop for the loads above; an empty split leaves m at -inf
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * scale_log2  # [BLOCK_G, BLOCK_N]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_i = tl.max(s, axis=1)
        m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
        p = tl.exp2(s - m_safe[:, None])
        l_i = tl.sum(p, axis=1)
        acc = tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        for tile_start in range(start + BLOCK_N, end, BLOCK_N):
            t = tile_start + tl.arange(0, BLOCK_N)
            valid = t < end
            block = tl.load(bt_row + t // PAGE_SIZE, mask=valid, other=0).to(tl.int64)
            kv_off = block * stride_cb + (t % PAGE_SIZE) * stride_cs + kvh * stride_ch  # [BLOCK_N]
            kv_mask = valid[:, None] & d_mask[None, :]
            k = tl.load(k_cache_ptr + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * scale_log2  # [BLOCK_G, BLOCK_N]
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: every later tile has a valid token
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(v_cache_ptr + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
            m_i = m_new

        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # empty split / context 0: zeros, not NaN
        out_mask = row_mask[:, None] & d_mask[None, :]
        if DIRECT:
            tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :],
                     o.to(out_ptr.dtype.element_ty), mask=out_mask)
        else:
            # workspace [B, Hq, EXTRA + S, D] and [B, Hq, EXTRA + S], contiguous
            slots = EXTRA + num_splits
            row = (b * (tl.num_programs(1) * GROUP) + heads).to(tl.int64) * slots + EXTRA + split
            tl.store(part_out_ptr + row[:, None] * HEAD_DIM + d[None, :], o, mask=out_mask)
            tl.store(part_lse_ptr + row, m_i + tl.log2(l_i), mask=row_mask)  # -inf when empty
            # Merge without a second launch: the split that finishes last for this (sequence,
            # kv head) merges them all. The CTA barrier + acq_rel atomic publish every thread's
            # partials before the count; .cg loads then read them from L2, past this SM's L1.
            tl.debug_barrier()
            counter = counters_ptr + b * tl.num_programs(1) + kvh
            arrived = tl.atomic_add(counter, 1, sem="acq_rel")
            if arrived == n_used - 1:
                tl.store(counter, 0)  # ready for the next launch or graph replay
                # (fresh names only inside this runtime `if`: Triton would try to merge rebinds)
                # Every query head of the group at once, the partials in chunks of
                # [heads, CHUNK_S, D]: a round trip per chunk, not one per head.
                mg = tl.arange(0, MERGE_G)
                mg_ok = mg < GROUP
                mg_heads = kvh * GROUP + mg
                mbase = (b * (tl.num_programs(1) * GROUP) + mg_heads).to(tl.int64) * slots
                n_merge = EXTRA + n_used        # the prefix partials, then the used splits
                all_s = tl.arange(0, BLOCK_S)
                lse_all = tl.load(part_lse_ptr + mbase[:, None] + all_s[None, :],
                                  mask=mg_ok[:, None] & (all_s < n_merge)[None, :],
                                  other=float("-inf"), cache_modifier=".cg")  # [MERGE_G, BLOCK_S]
                m_all = tl.max(lse_all, axis=1)
                m_all = tl.where(m_all == float("-inf"), 0.0, m_all)
                den = tl.sum(tl.exp2(lse_all - m_all[:, None]), axis=1)  # 0 for empty rows
                den = tl.where(den == 0.0, 1.0, den)
                acc_m = tl.zeros([MERGE_G, BLOCK_D], dtype=tl.float32)
                for c0 in range(0, n_merge, CHUNK_S):
                    sc = c0 + tl.arange(0, CHUNK_S)
                    c_ok = mg_ok[:, None] & (sc < n_merge)[None, :]  # [MERGE_G, CHUNK_S]
                    c_rows = mbase[:, None] + sc[None, :]
                    lse_c = tl.load(part_lse_ptr + c_rows, mask=c_ok, other=float("-inf"),
                                    cache_modifier=".cg")
                    w_c = tl.exp2(lse_c - m_all[:, None])  # 0 where masked or empty
                    parts = tl.load(part_out_ptr + c_rows[:, :, None] * HEAD_DIM + d[None, None, :],
                                    mask=c_ok[:, :, None] & d_mask[None, None, :], other=0.0,
                                    cache_modifier=".cg")  # [MERGE_G, CHUNK_S, BLOCK_D]
                    acc_m += tl.sum(parts * w_c[:, :, None], axis=1)
                tl.store(out_ptr + b * stride_ob + mg_heads[:, None] * stride_oh + d[None, :],
                         (acc_m / den[:, None]).to(out_ptr.dtype.element_ty),
                         mask=mg_ok[:, None] & d_mask[None, :])


@triton.jit
def _combine_splits_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, num_splits, num_heads, stride_on, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, USE_PDL: tl.constexpr,
):
    wait_prior(USE_PDL)
    row = tl.program_id(0).to(tl.int64)  # (token or sequence) * num_heads + head
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_mask = s < num_splits
    lse = tl.load(part_lse_ptr + row * num_splits + s, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)  # [BLOCK_S]; 0 for empty splits
    denom = tl.sum(w, axis=0)
    denom = tl.where(denom == 0.0, 1.0, denom)
    o = tl.load(part_out_ptr + (row * num_splits + s)[:, None] * HEAD_DIM + d[None, :],
                mask=s_mask[:, None] & (d < HEAD_DIM)[None, :], other=0.0)
    o = tl.sum(o * w[:, None], axis=0) / denom
    dst = out_ptr + (row // num_heads) * stride_on + (row % num_heads) * stride_oh + d
    tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def combine_splits(part_out: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor,
                   pdl: bool = True) -> None:
    """Merge split partials [R, H, S, D] + lse [R, H, S] (log2 domain) into out [R, H, D] (the
    prefill kernel's splits; decode merges inside its own kernel)."""
    rows, heads, splits, head_dim = part_out.shape
    pdl = use_pdl(out, pdl)
    _combine_splits_kernel[(rows * heads,)](
        part_out, part_lse, out, splits, heads, out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_S=triton.next_power_of_2(splits), USE_PDL=pdl, num_warps=1 if head_dim <= 64 else 2,
        launch_pdl=pdl,
    )


def choose_num_splits(batch: int, num_kv_heads: int, max_context: int, device: torch.device) -> int:
    """Enough programs for ~2 waves on the GPU (one from WIDE_FROM_PROGRAMS pairs; below them
    also no split longer than LONG_SPLIT_TOKENS), but no split shorter than MIN_SPLIT_TOKENS.
    max_context bounds every row's context: the block table's width, or a graph's context cap."""
    programs = max(1, batch * num_kv_heads)
    waves = 1 if programs >= WIDE_FROM_PROGRAMS else WAVES
    want = triton.cdiv(waves * num_sms(device), programs)
    if programs < WIDE_FROM_PROGRAMS:
        want = max(want, triton.cdiv(max_context, LONG_SPLIT_TOKENS))
    return max(1, min(want, MAX_SPLITS, triton.cdiv(max_context, MIN_SPLIT_TOKENS)))


def launch_config(programs: int, num_splits: int, bound: int) -> dict:
    """The kernel's tile and pipeline for `programs` (sequence, KV head) pairs in num_splits
    splits of a context bounded by `bound` tokens: shapes only, so a graph's replays agree."""
    if num_splits == 1:
        if programs >= WIDE_FROM_PROGRAMS:
            return {**DIRECT_LAUNCH, "BLOCK_N": DIRECT_WIDE_BLOCK_N}
        return dict(DIRECT_LAUNCH)
    if bound // num_splits >= SPLIT_WIDE_MIN_TOKENS:
        return dict(SPLIT_WIDE_LAUNCH)
    return dict(SPLIT_LAUNCH)


def context_caps(batch: int, num_kv_heads: int, max_context: int, device: torch.device,
                 caps: tuple[int, ...]) -> list[int]:
    """Of `caps` (KernelConfig.attn_context_caps, ascending), the context bounds below
    max_context that would launch fewer splits at this batch, the largest one per split count,
    ascending. A decode graph is captured once per bound (plus the unbounded one) and a step
    replays the smallest that holds its longest context: a graph's grid is fixed, and a short
    context's empty splits still cost (one H200, batch 1, 256 tokens, Qwen3-0.6B: 32 splits
    5.1 us a layer, 8 splits 4.0)."""
    full = choose_num_splits(batch, num_kv_heads, max_context, device)
    by_splits: dict[int, int] = {}
    for cap in caps:
        n = choose_num_splits(batch, num_kv_heads, cap, device)
        if cap < max_context and n < full:
            by_splits[n] = cap
    return sorted(by_splits.values())


def workspace(device, batch, num_heads, num_kv_heads, head_dim, num_splits):
    """(partials [B, Hq, S, D] fp32, lse [B, Hq, S] fp32, arrival counters [B, Hkv] int32),
    cached per shape."""
    key = (device, batch, num_heads, num_kv_heads, head_dim, num_splits)
    ws = _WORKSPACES.get(key)
    if ws is None:
        ws = (torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=device),
              torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=device),
              # arrival counts per (sequence, kv head); the merging program resets its count to 0
              torch.zeros(batch, num_kv_heads, dtype=torch.int32, device=device))
        _WORKSPACES[key] = ws
    return ws


def check_paged_inputs(name: str, q: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor) -> None:
    """What every paged attention launcher needs of q [.., Hq, D] and the k/v caches."""
    num_q_heads, num_kv_heads = q.shape[-2], k_cache.shape[-2]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or k_cache.stride() != v_cache.stride():
        raise ValueError(f"{name} needs a contiguous head_dim and one layout for k/v caches")


def paged_decode_attention(
    q: torch.Tensor,             # [B, Hq, D]
    k_cache: torch.Tensor,       # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,       # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    context_lens: torch.Tensor,  # [B] int32, KV length including the current token; 0 = padding row
    scale: float,
    out: torch.Tensor | None = None,  # [B, Hq, D]
    num_splits: int | None = None,    # None: chosen from shapes (tests force a value)
    max_context: int | None = None,   # a bound on every context_lens value (graphs: the capture's cap)
    launch: dict | None = None,       # None: launch_config's; else BLOCK_N, num_warps, num_stages
    pdl: bool = True,                 # launch with PDL where the GPU has it (KernelConfig.pdl)
    first: torch.Tensor | None = None,  # [B] int32: each row's first key (cascade's suffix)
    prefix_slots: int = 0,            # cascade: partials already in the workspace's first slots
) -> torch.Tensor:
    batch, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    check_paged_inputs("paged_decode_attention", q, k_cache, v_cache)
    if out is None:
        out = torch.empty_like(q)
    if batch == 0:
        return out
    group = num_q_heads // num_kv_heads
    bound = min(block_tables.shape[1] * page_size, max_context or (1 << 62))
    if num_splits is None:
        num_splits = choose_num_splits(batch, num_kv_heads, bound, q.device)
    direct = num_splits == 1 and not prefix_slots
    if direct:
        part_out = part_lse = counters = out  # unused
    else:
        part_out, part_lse, counters = workspace(q.device, batch, num_q_heads, num_kv_heads,
                                                 head_dim, prefix_slots + num_splits)
    if launch is None:
        launch = launch_config(batch * num_kv_heads, num_splits, bound)
    pdl = use_pdl(q, pdl)
    block_d = max(16, triton.next_power_of_2(head_dim))
    merge_g = max(2, triton.next_power_of_2(group))
    slots = prefix_slots + num_splits
    chunk_s = max(1, min(triton.next_power_of_2(slots), MERGE_CHUNK_ELEMS // (merge_g * block_d)))
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, out, part_out, part_lse, counters,
        first if first is not None else context_lens, scale * math.log2(math.e), num_splits,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        BLOCK_D=block_d, PAGE_SIZE=page_size, BLOCK_N=launch["BLOCK_N"], DIRECT=direct,
        BLOCK_S=triton.next_power_of_2(slots), DOT_PREC=dot_precision(q.dtype), USE_PDL=pdl,
        MERGE_G=merge_g, CHUNK_S=chunk_s, EXTRA=prefix_slots, num_warps=launch["num_warps"],
        num_stages=launch["num_stages"], launch_pdl=pdl,
    )
    return out


def gather_context(
    cache: torch.Tensor, block_tables: torch.Tensor, num_tokens: int,
) -> torch.Tensor:  # [B, num_tokens, Hkv, D]: the first num_tokens positions of each row, in order
    page_size = cache.shape[1]
    num_blocks = triton.cdiv(num_tokens, page_size)
    # unused table entries may hold anything (e.g. -1): clamp so the gather stays in bounds
    ids = block_tables[:, :num_blocks].long().clamp(0, cache.shape[0] - 1)
    gathered = cache[ids]  # [B, num_blocks, page_size, Hkv, D]
    return gathered.flatten(1, 2)[:, :num_tokens]


def paged_decode_attention_ref(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, scale: float, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Torch reference (and the CPU path): gather each row's context, one masked batched SDPA."""
    batch, num_q_heads, head_dim = q.shape
    if out is None:
        out = torch.empty_like(q)
    max_ctx = int(context_lens.max()) if batch else 0
    if max_ctx == 0:
        return out.zero_()
    valid = torch.arange(max_ctx, device=q.device)[None, :] < context_lens[:, None]  # [B, T]
    # slots past a row's context may hold anything, NaN included; 0 * NaN would leak through SDPA
    keep = valid[:, None, :, None]
    k = gather_context(k_cache, block_tables, max_ctx).transpose(1, 2).float().where(keep, 0.0)  # [B, Hkv, T, D]
    v = gather_context(v_cache, block_tables, max_ctx).transpose(1, 2).float().where(keep, 0.0)
    o = F.scaled_dot_product_attention(
        q.float()[:, :, None, :], k, v, attn_mask=valid[:, None, None, :], scale=scale,
        enable_gqa=num_q_heads != k.shape[1],
    )[:, :, 0]  # [B, Hq, D]
    o = torch.where(context_lens[:, None, None] > 0, o, 0.0)  # a fully masked row comes back NaN
    out.copy_(o)
    return out


def paged_decode_attention_cpu(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, scale: float, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The engine's CPU path: the reference without its defences against garbage in unused
    slots (the engine's cache starts zeroed, its block tables zero-padded), and with no mask
    when every row has the same context (always at batch 1)."""
    batch, num_q_heads, _ = q.shape
    lens = context_lens.tolist()
    max_ctx = max(lens) if lens else 0
    if max_ctx == 0 or min(lens) == 0:
        return paged_decode_attention_ref(q, k_cache, v_cache, block_tables, context_lens, scale, out)
    nb = -(-max_ctx // k_cache.shape[1])
    ids = block_tables[:, :nb].reshape(-1).long()                   # index_select: no gather kernel
    k = k_cache.index_select(0, ids).view(batch, -1, *k_cache.shape[2:])[:, :max_ctx]
    v = v_cache.index_select(0, ids).view(batch, -1, *v_cache.shape[2:])[:, :max_ctx]
    k, v = k.transpose(1, 2), v.transpose(1, 2)                     # [B, Hkv, T, D]
    mask = None
    if min(lens) != max_ctx:
        mask = (torch.arange(max_ctx)[None, :] < context_lens[:, None])[:, None, None, :]
    o = F.scaled_dot_product_attention(q[:, :, None, :], k, v, attn_mask=mask, scale=scale,
                                       enable_gqa=num_q_heads != k.shape[1])[:, :, 0]
    if out is None:
        return o
    out.copy_(o)
    return out
