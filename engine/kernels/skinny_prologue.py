"""What the skinny GEMM does to x before the product: nothing, or an RMSNorm with the residual add
fused. Folding the norm into the GEMM that consumes it saves a launch and a round trip of x
through memory: at batch 1 most of what the ~2 us norm kernel cost in a chain of ~265.

Every program recomputes the prologue for its own chunks of x (a row of a few thousand values,
read from L2). Two forms:
  * X_RMSNORM: the sum of squares over the whole row in a pass before the loop, then HF's
    rounding points (rmsnorm.py): the two launches' result up to the order of the fp32 sum of
    squares. Works with split-K.
  * X_RMSNORM_FACTORED: the sum of squares gathered in the main loop and 1/rms applied to the
    product (out = rstd * (W @ (x * w_norm))): one pass over x, so faster, but x * rstd is never
    rounded to the dtype as HF rounds it (a bf16 ulp here and there). Needs the whole row in
    one program (no split-K); the launcher falls back to X_RMSNORM otherwise."""
import triton
import triton.language as tl

X_PLAIN, X_RMSNORM, X_RMSNORM_FACTORED = 0, 1, 3


@triton.jit
def load_chunk(ptrs, mask, EVEN_K: tl.constexpr):
    if EVEN_K:  # every chunk full: no mask at all (16-byte vector loads)
        return tl.load(ptrs)
    return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def row_rstd(x_ptr, res_ptr, rows_m, stride_xm, stride_rm, K, eps,
             HAS_RESIDUAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """(1 / sqrt(mean((x + residual)^2) + eps), sum of squares) per row, over all K: [BLOCK_M]."""
    offs_k = tl.arange(0, BLOCK_K)[None, :]
    sq = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        ok = kk < K
        v = tl.load(x_ptr + rows_m[:, None] * stride_xm + kk, mask=ok, other=0.0)
        if HAS_RESIDUAL:  # HF adds in the model dtype
            r = tl.load(res_ptr + rows_m[:, None] * stride_rm + kk, mask=ok, other=0.0)
            v = (v.to(tl.float32) + r.to(tl.float32)).to(v.dtype)
        vf = v.to(tl.float32)
        sq += tl.sum(vf * vf, axis=1)
    return tl.rsqrt(sq / K + eps), sq


@triton.jit
def x_chunk(x_ptr, x_rows, kk, k_ok, K, res_ptr, r_rows, res_out_ptr, ro_rows, store_ok,
            first_col, norm_w_ptr, rstd, X_MODE: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
            EVEN_K: tl.constexpr):
    """One chunk of the GEMM's x operand (its tile shape is that of x_rows + kk), and the
    residual-stream values it came from (x itself in the plain mode)."""
    v = load_chunk(x_ptr + x_rows + kk, k_ok, EVEN_K)
    s = v
    if X_MODE != 0:
        if HAS_RESIDUAL:
            r = load_chunk(res_ptr + r_rows + kk, k_ok, EVEN_K)
            v = (v.to(tl.float32) + r.to(tl.float32)).to(v.dtype)
            if first_col:  # the true residual stream, written once: by the first column of programs
                tl.store(res_out_ptr + ro_rows + kk, v, mask=store_ok)
        s = v
        w = load_chunk(norm_w_ptr + kk, k_ok, EVEN_K)
        if X_MODE == 1:
            v = (v.to(tl.float32) * rstd).to(v.dtype)  # HF rounds before the weight
        v = (v.to(tl.float32) * w.to(tl.float32)).to(v.dtype)
    return v, s
