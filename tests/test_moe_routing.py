"""The router kernels (engine/kernels/moe_routing.py: one token a program, top-k by k passes of
max-and-mask) on the CPU through the Triton interpreter, against their torch reference and HF's
Qwen2-MoE / Qwen3-MoE routers. (They replaced a kernel that ranked every pair of experts; its
bench, bench/router.py, and the tests that it picked the same experts are gone with it, their
figures in bench/RESULTS.md, 2026-12-02.)

Inputs are fresh random draws each run (the seed is in every failure message); the fixed cases
are the ones random draws rarely hit: exact ties, probabilities that underflow to the same 0,
-inf (masked) experts, signed zeros."""

import os

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen2MoeConfig, Qwen3MoeConfig
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from engine.kernels.moe_routing import _route_triton, route_counts, route_hidden, route_ref

pytestmark = pytest.mark.usefixtures("triton_interpreter")

# (tokens, experts, top_k): Qwen3-MoE's 128/8, Qwen1.5-MoE's 60/4 (not a power of two), a top_k
# that is not one either, top_k == experts
SHAPES = [(1, 128, 8), (9, 128, 8), (5, 60, 4), (7, 40, 6), (3, 8, 8), (4, 60, 3)]


def _seed() -> int:
    return int.from_bytes(os.urandom(4), "little")


def _stable_topk(z: torch.Tensor, k: int) -> torch.Tensor:
    """The kernel's defined order: a stable descending sort of the logits (ties to the lower expert)."""
    return torch.sort(z.float(), dim=-1, descending=True, stable=True).indices[:, :k]


def _assert_valid_topk_of_probs(probs_ref, w, ids, k, norm, msg):
    """What torch.topk promises (and HF relies on): the k largest probabilities, in descending
    order, k distinct experts; among exactly equal probabilities any may be chosen."""
    assert all(len(set(r)) == k for r in ids.tolist()), msg
    top = torch.topk(probs_ref, k).values
    got = probs_ref.gather(1, ids.long())
    torch.testing.assert_close(got, top, rtol=0, atol=0, msg=msg)
    want_w = top / top.sum(-1, keepdim=True) if norm else top
    torch.testing.assert_close(w, want_w, rtol=1e-5, atol=1e-7, msg=msg)


@pytest.mark.parametrize("block_t", [1, 2, 4])
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("n,experts,top_k", SHAPES)
def test_route_kernel_matches_reference_on_random_logits(n, experts, top_k, norm, block_t):
    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(n, experts, generator=g)  # fp32: ties have probability ~0
    probs, w, ids = _route_triton(logits, top_k, norm, block_t=block_t)
    probs_r, w_r, ids_r = route_ref(logits, top_k, norm)
    msg = f"seed {seed}"
    assert probs.dtype == w.dtype == torch.float32 and ids.dtype == torch.int32, msg
    assert ids.shape == w.shape == (n, top_k) and probs.shape == (n, experts), msg
    torch.testing.assert_close(probs, probs_r, rtol=1e-5, atol=1e-7, msg=msg)
    assert torch.equal(ids, ids_r), msg
    torch.testing.assert_close(w, w_r, rtol=1e-5, atol=1e-7, msg=msg)


@pytest.mark.parametrize("block_t", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n,experts,top_k", [(9, 128, 8), (6, 60, 4), (5, 40, 6)])
def test_route_kernel_on_tied_logits_is_a_stable_sort_and_a_valid_topk(n, experts, top_k, dtype, block_t):
    """Integer-valued logits: most of the top-k boundary is exact ties. The kernel takes the lower
    expert among equals (a stable descending sort), which is one of the answers torch.topk may give."""
    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    logits = torch.randint(-3, 3, (n, experts), generator=g).to(dtype)
    for norm in (True, False):
        probs, w, ids = _route_triton(logits, top_k, norm, block_t=block_t)
        msg = f"seed {seed} norm {norm}"
        assert torch.equal(ids.long(), _stable_topk(logits, top_k)), msg
        _assert_valid_topk_of_probs(route_ref(logits, top_k, norm)[0], w, ids, top_k, norm, msg)
        want_w = probs.gather(1, ids.long())
        want_w = want_w / want_w.sum(-1, keepdim=True) if norm else want_w
        torch.testing.assert_close(w, want_w, rtol=1e-6, atol=1e-7, msg=msg)


def test_route_kernel_orders_underflowed_probabilities_by_their_logits():
    """exp underflows: experts 1, 2, 3, 4, 6, 7 all get probability 0.0. Any of them is a valid
    torch.topk answer (HF's CPU topk happens to pick 6 here); the kernel keeps its logit order."""
    logits = torch.tensor([[0.0, -200.0, -300.0, -150.0, -120.0, 5.0, -400.0, -110.0]] * 2)
    probs, w, ids = _route_triton(logits, 4, False)
    assert ids.tolist() == [[5, 0, 7, 4]] * 2
    _assert_valid_topk_of_probs(route_ref(logits, 4, False)[0], w, ids, 4, False, "underflow")


@pytest.mark.parametrize("block_t", [1, 2])
def test_route_kernel_takes_masked_experts_last_and_never_twice(block_t):
    """An intervention masks experts with -inf logits. When fewer than k experts stay live, the
    rest of the k are masked ones, in index order, weight 0 -- never a repeat of a chosen one."""
    logits = torch.full((3, 8), float("-inf"))
    logits[:, 5], logits[:, 2] = 1.0, 0.0
    logits[2] = torch.tensor([0.5, float("-inf"), -1.0, float("-inf"), 2.0, float("-inf"), 0.0, -3.0])
    probs, w, ids = _route_triton(logits, 6, True, block_t=block_t)
    assert ids.tolist()[:2] == [[5, 2, 0, 1, 3, 4]] * 2
    assert ids.tolist()[2] == [4, 0, 6, 2, 7, 1]
    assert (w[:2, 2:] == 0).all() and (w[2, 5:] == 0).all()
    _assert_valid_topk_of_probs(route_ref(logits, 6, True)[0], w, ids, 6, True, "masked")


def test_route_kernel_ties_signed_zeros():
    logits = torch.tensor([[-0.0, -1.0, 0.0, -2.0], [0.0, -1.0, -0.0, -2.0]])
    assert _route_triton(logits, 2, False)[2].tolist() == [[0, 2], [0, 2]]


def _hf_router(arch: str, experts: int, top_k: int, norm: bool, hidden: int, seed: int):
    kw = dict(hidden_size=hidden, num_experts=experts, num_experts_per_tok=top_k, norm_topk_prob=norm)
    cfg = Qwen3MoeConfig(**kw) if arch == "qwen3" else Qwen2MoeConfig(**kw)
    router = (Qwen3MoeTopKRouter if arch == "qwen3" else Qwen2MoeTopKRouter)(cfg)
    with torch.no_grad():
        router.weight.copy_(torch.randn(experts, hidden, generator=torch.Generator().manual_seed(seed)))
    return router


@pytest.mark.parametrize("arch,experts,top_k,norm", [
    ("qwen3", 128, 8, True), ("qwen3", 16, 4, False), ("qwen2", 60, 4, False), ("qwen2", 60, 4, True),
])
def test_route_kernels_match_hf_routers(arch, experts, top_k, norm):
    """HF's Qwen3MoeTopKRouter / Qwen2MoeTopKRouter (softmax in fp32, top-k of the probabilities,
    optional renormalisation, weights cast to the logits' dtype), fp32: the routing kernel on HF's
    logits, and the fused router on the hidden states, pick HF's experts with HF's weights."""
    seed = _seed()
    hidden, n = 32, 5
    router = _hf_router(arch, experts, top_k, norm, hidden, seed)
    x = torch.randn(n, hidden, generator=torch.Generator().manual_seed(seed + 1))
    with torch.no_grad():
        logits_hf, w_hf, ids_hf = router(x)
    msg = f"seed {seed}"
    for probs, w, ids in (_route_triton(logits_hf, top_k, norm),
                          route_hidden(x, router.weight.detach(), top_k, norm, route_counts("cpu"))):
        assert torch.equal(ids.long(), ids_hf), msg
        torch.testing.assert_close(w.to(logits_hf.dtype), w_hf, rtol=1e-5, atol=1e-6, msg=msg)
        torch.testing.assert_close(probs, torch.softmax(logits_hf, -1, dtype=torch.float32),
                                   rtol=1e-5, atol=1e-6, msg=msg)


@pytest.mark.parametrize("tile", [(1, 2, 4), (2, 2, 4), (2, 8, 2), (4, 4, 4), (8, 2, 4)])
@pytest.mark.parametrize("n,experts,top_k,dtype", [(5, 60, 4, torch.float32), (9, 40, 6, torch.float16)])
def test_route_hidden_any_tile_equals_router_linear_then_route(n, experts, top_k, dtype, tile):
    """Every (tokens, experts, warps) tile of the fused router: the logits rounded to x's dtype as
    F.linear's are, then the same routing as the two-step path; the semaphores reset. fp16 takes
    integer-valued x and gate / 8: every sum is exact in any order, so the logits are F.linear's
    bit for bit (random fp16 ones round differently ~1 in 10^4) and tie often."""
    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    hidden = 48
    if dtype == torch.float32:
        x = torch.randn(n, hidden, generator=g)
        gate = torch.randn(experts, hidden, generator=g) / hidden**0.5
    else:
        x = torch.randint(-2, 3, (n, hidden), generator=g).to(dtype)
        gate = (torch.randint(-2, 3, (experts, hidden), generator=g) / 8).to(dtype)
    counts = route_counts("cpu")
    probs, w, ids = route_hidden(x, gate, top_k, True, counts, tile=tile)
    logits = F.linear(x.float(), gate.float()).to(dtype)
    probs_r = route_ref(logits, top_k, True)[0]
    msg = f"seed {seed}"
    torch.testing.assert_close(probs, probs_r, rtol=1e-5, atol=1e-6, msg=msg)
    assert torch.equal(ids.long(), _stable_topk(logits, top_k)), msg
    _assert_valid_topk_of_probs(probs_r, w, ids, top_k, True, msg)
    assert bool((counts == 0).all()), "the semaphores must reset for the next launch"


@pytest.mark.parametrize("tile", [None, (2, 2, 1), (4, 4, 4)])
@pytest.mark.parametrize("n,hidden,dtype", [(1, 48, torch.float32), (5, 600, torch.float32),
                                            (3, 1100, torch.float16), (2, 64, torch.float16)])
def test_norm_route_hidden_is_the_post_attention_norm_then_route_hidden(n, hidden, dtype, tile):
    """The post-attention RMSNorm folded into the fused router (MoE decode steps): its normed rows
    and residual stream are fused_add_rms_norm's (hidden 600 / 1,100: several K chunks and a
    masked tail), every program's routing is route_hidden's of those very rows (the same products
    in the same order: equal experts, not near-equal), and the semaphores reset. No bf16 here:
    the interpreter truncates fp32 -> bf16 (tests/test_moe_kernels_gpu.py has bf16)."""
    from engine.kernels.moe_routing import norm_route_hidden
    from engine.kernels.rmsnorm import fused_add_rms_norm_ref
    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    experts, top_k, eps = 60, 4, 1e-6
    h = (torch.randn(n, hidden, generator=g) * 3).to(dtype)
    r = (torch.randn(n, hidden, generator=g) * 5).to(dtype)
    nw = (1 + 0.5 * torch.randn(hidden, generator=g)).to(dtype)
    gate = (torch.randn(experts, hidden, generator=g) / hidden**0.5).to(dtype)
    counts = route_counts("cpu")
    probs, w, ids, normed, res = norm_route_hidden(h, r, nw, eps, gate, top_k, True, counts,
                                                   tile=tile)
    msg = f"seed {seed}"
    normed_ref, res_ref = fused_add_rms_norm_ref(h, r, nw, eps)
    assert torch.equal(res, res_ref), msg
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(normed, normed_ref, msg=msg, **tol)
    if dtype != torch.float32:  # the sum of squares in another order: a rare last-bit rounding
        assert (normed != normed_ref).float().mean() < 0.02, msg
    probs2, w2, ids2 = route_hidden(normed, gate, top_k, True, route_counts("cpu"), tile=tile)
    assert torch.equal(ids, ids2), msg
    torch.testing.assert_close(probs, probs2, rtol=0, atol=0, msg=msg)
    torch.testing.assert_close(w, w2, rtol=0, atol=0, msg=msg)
    assert bool((counts == 0).all()), "the semaphores must reset for the next launch"


def test_norm_route_hidden_rejects_mismatched_inputs():
    from engine.kernels.moe_routing import norm_route_hidden
    h = torch.randn(2, 32)
    gate = torch.randn(8, 32)
    with pytest.raises(ValueError, match="residual"):
        norm_route_hidden(h, torch.randn(3, 32), torch.ones(32), 1e-6, gate, 2, True, route_counts("cpu"))
    with pytest.raises(ValueError, match="norm_weight"):
        norm_route_hidden(h, torch.randn(2, 32), torch.ones(16), 1e-6, gate, 2, True, route_counts("cpu"))
