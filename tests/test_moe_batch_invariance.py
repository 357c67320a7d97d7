"""A token's MoE output depends on that token alone, not on which tokens share its step (fp32,
CPU): untouched requests beside a request whose experts are masked keep their logprobs bit for
bit, and at the layer level each token's expert output equals its output computed alone.

Why it needs care: the experts' GEMMs group a step's (token, k) pairs by expert, so another
request's routing changes how many rows an expert's GEMM has and where a token's row sits, and a
BLAS GEMM's result for one row depends on both (MKL: M = 1 takes a GEMV, rows in a full register
panel and rows in the remainder are summed in different orders)."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, Intervention
from engine.kernels.fused_moe import fused_moe_ref
from engine.kernels.moe_routing import route_ref
from engine.kernels.moe_cpu import fused_moe_cpu
from test_generate_vs_hf import greedy_params, random_prompts

ARCH_MASKS = {  # MoE layers of the tiny configs: qwen3_moe all three, qwen2_moe 0 and 2
    "qwen3_moe": [Intervention.mask_experts(0, [0, 1, 2, 3]), Intervention.mask_experts(2, [5, 6])],
    "qwen2_moe": [Intervention.mask_experts(0, [1, 2, 3, 4]), Intervention.mask_experts(-1, [0])],
}


def _logprob_tensor(out) -> torch.Tensor:
    """[tokens, 1 + top-k]: the sampled token's logprob and the top-k logprobs, as float64."""
    return torch.tensor([[t.logprob, *t.top.values()] for t in out.logprobs], dtype=torch.float64)


def assert_bitwise(a, b, what: str) -> None:
    assert a.token_ids == b.token_ids, f"{what}: tokens differ"
    assert [list(t.top) for t in a.logprobs] == [list(t.top) for t in b.logprobs], what
    assert torch.equal(_logprob_tensor(a), _logprob_tensor(b)), f"{what}: logprobs differ in bits"


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_untouched_requests_beside_a_masked_expert_request_are_equal_bit_for_bit(model_factory, arch):
    path = model_factory(arch)
    untouched = random_prompts([9, 23, 14], seed=311)
    neighbour = random_prompts([31], seed=312)[0]
    prompts = [untouched[0], neighbour, untouched[1], untouched[2]]
    masks = ARCH_MASKS[arch]
    other_masks = [Intervention.mask_experts(masks[0].layer, [6, 7])]
    # no prefix cache: both runs compute the very same steps for the untouched requests
    with LLM(path, device="cpu", enable_prefix_caching=False) as llm:
        plain = llm.generate(prompts, greedy_params())
        masked = llm.generate(prompts, greedy_params(), interventions=[None, masks, None, None])
        other = llm.generate(prompts, greedy_params(), interventions=[None, other_masks, None, None])
        steps = llm.inspect().steps
    assert len(steps[-2].entries) == len(prompts), "the requests were not batched together"
    assert _logprob_tensor(masked[1]).tolist() != _logprob_tensor(plain[1]).tolist(), \
        "the mask changed nothing: the test proves nothing"
    for i in (0, 2, 3):
        assert_bitwise(masked[i], plain[i], f"request {i} beside a masked neighbour")
        assert_bitwise(other[i], plain[i], f"request {i} beside another mask")


# ---- the experts: each token's output equals its output alone ------------------------------------
def _experts(arch: str, seed: int):
    """Random expert and router weights of the tiny configs' sizes (tests/tiny_models.py)."""
    from tiny_models import make_config
    cfg = make_config(arch)
    g = torch.Generator().manual_seed(seed)
    e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    w13 = torch.randn(e, 2 * i, h, generator=g) * 0.1            # [E, 2I, H]
    w2 = torch.randn(e, h, i, generator=g) * 0.1                 # [E, H, I]
    gate = torch.randn(e, h, generator=g) * 0.3                  # [E, H]
    return w13, w2, gate, cfg


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
@pytest.mark.parametrize("num_tokens", [2, 7, 40])
def test_each_tokens_expert_output_equals_its_output_alone(arch, num_tokens):
    w13, w2, gate, cfg = _experts(arch, seed=num_tokens)
    x = torch.randn(num_tokens, cfg.hidden_size, generator=torch.Generator().manual_seed(7 + num_tokens))
    _, w, ids = route_ref(x @ gate.t(), cfg.num_experts_per_tok, bool(cfg.norm_topk_prob))
    batch = fused_moe_cpu(x, w13, w2, w, ids)
    for t in range(num_tokens):
        alone = fused_moe_cpu(x[t:t + 1], w13, w2, w[t:t + 1], ids[t:t + 1])
        assert torch.equal(batch[t], alone[0]), f"token {t} of {num_tokens}"


def test_a_tokens_expert_output_ignores_the_others_routing():
    """The same tokens, their neighbours routed elsewhere (experts masked for those only)."""
    w13, w2, gate, cfg = _experts("qwen3_moe", seed=5)
    x = torch.randn(33, cfg.hidden_size, generator=torch.Generator().manual_seed(6))
    logits = x @ gate.t()
    _, w, ids = route_ref(logits, cfg.num_experts_per_tok, True)
    masked = logits.clone()
    masked[::2, :4] = float("-inf")                       # the even tokens lose experts 0-3
    _, w_m, ids_m = route_ref(masked, cfg.num_experts_per_tok, True)
    assert not torch.equal(ids[::2], ids_m[::2])
    a = fused_moe_cpu(x, w13, w2, w, ids)
    b = fused_moe_cpu(x, w13, w2, w_m, ids_m)
    assert torch.equal(a[1::2], b[1::2])


def test_cpu_experts_equal_the_hf_order_reference():
    """Another summation order than HF's (M = 1 products, summed by top-k slot), the same values."""
    w13, w2, gate, cfg = _experts("qwen2_moe", seed=9)
    x = torch.randn(50, cfg.hidden_size, generator=torch.Generator().manual_seed(10))
    _, w, ids = route_ref(x @ gate.t(), cfg.num_experts_per_tok, False)
    torch.testing.assert_close(fused_moe_cpu(x, w13, w2, w, ids),
                               fused_moe_ref(x, w13, w2, w, ids), rtol=1e-5, atol=1e-6)
