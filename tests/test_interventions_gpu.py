"""Interventions on the GPU: decode steps with an intervened request replay a CUDA-graph variant
(tables refilled each replay) and give the tokens of the CPU path and of eager GPU steps (every
kind, an attention clamp included); the untouched requests of the batch keep the tokens they
have without it, and beside a masked-expert request their logprobs bit for bit in bf16; the
expert kernels' rows depend on their own token only; the fused router kernel masks experts."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engine import LLM, Intervention, ProbeSpec, SamplingParams

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [3, 4, 5],
           list(range(30, 70))]
SP = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)


def _ivs(arch: str) -> list:
    v = torch.randn(64, generator=torch.Generator().manual_seed(3))
    ivs = [Intervention.ablate_heads(1, [0, 3]), Intervention.steer(-1, v, 2.0, "generated")]
    if arch == "qwen3_moe":
        ivs.append(Intervention.mask_experts(0, [0, 1, 2]))
    # prompt 0 has 17 tokens: 18 is its second generated token's key
    ivs.append(Intervention.clamp_attention(0, [2], [0, 1, 5, 18]))
    return ivs


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_graph_replays_with_interventions_equal_cpu_and_eager(model_factory, arch):
    path = model_factory(arch)
    ivs = _ivs(arch)
    per = [ivs, None, ivs]
    with LLM(path, device="cpu", num_kv_blocks=128, block_size=16) as cpu:
        ref = [o.token_ids for o in cpu.generate(PROMPTS, SP, interventions=per)]
        plain = [o.token_ids for o in cpu.generate(PROMPTS, SP)]
    assert ref[0] != plain[0]
    for eager in (False, True):
        with LLM(path, device="cuda", dtype="float32", num_kv_blocks=128, block_size=16,
                 max_num_seqs=8, enforce_eager=eager) as gpu:
            got = [o.token_ids for o in gpu.generate(PROMPTS, SP, interventions=per)]
            again = [o.token_ids for o in gpu.generate(PROMPTS, SP)]   # graphs without tables
            buckets = {s.graph_bucket for s in gpu.inspect().steps}
        assert got == ref, f"eager={eager}"
        assert again == plain, f"eager={eager}: the plain run after an intervened one changed"
        if not eager:
            assert buckets - {None}, "decode steps should replay CUDA graphs"


def test_graph_variant_serves_another_request_with_the_same_key(model_factory):
    """One captured variant, new values: another vector at the same layer steers differently."""
    path = model_factory("qwen3")
    outs = {}
    for device in ("cpu", "cuda"):
        with LLM(path, device=device, dtype="float32", num_kv_blocks=128, block_size=16,
                 max_num_seqs=8) as llm:
            outs[device] = [llm.generate(PROMPTS[:1], SP, interventions=[
                Intervention.steer(2, torch.full((64,), s), 1.0)])[0].token_ids
                for s in (0.5, -0.5, 1.5)]
    assert outs["cuda"] == outs["cpu"]
    assert len({tuple(t) for t in outs["cpu"]}) > 1


def test_bf16_graph_with_probes_and_interventions_runs(model_factory):
    path = model_factory("qwen3_moe")
    with LLM(path, device="cuda", dtype="bfloat16", num_kv_blocks=128, block_size=16,
             max_num_seqs=8) as llm:
        out = llm.generate(PROMPTS, SP, watch=[ProbeSpec(), None, None],
                           interventions=[_ivs("qwen3_moe"), None, None])
        tr = llm.trace(out[0].request_id)
    _, ids, _ = tr.routing()
    assert not np.isin(ids[:, tr.moe_layers.index(0)], [0, 1, 2]).any()


@pytest.mark.parametrize("n", [1, 7, 33])
def test_route_hidden_bias_on_gpu(n):
    import torch.nn.functional as F

    from engine.kernels.moe_routing import route_counts, route_hidden, route_ref
    E, k, H = 128, 8, 2048
    x = torch.randn(n, H, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(E, H, device="cuda") / H ** 0.5).to(torch.bfloat16)
    bias = torch.zeros(n, E, device="cuda")
    bias[:, :64] = float("-inf")
    probs, tw, ids = route_hidden(x, w, k, True, route_counts("cuda"), bias=bias)
    assert (ids >= 64).all()
    rp, rw, rids = route_ref(F.linear(x, w).float() + bias, k, True)
    torch.testing.assert_close(probs, rp, rtol=2e-2, atol=1e-3)


# ---- untouched requests beside a masked-expert request: bit for bit in bf16 ----------------------
def _lp(out) -> torch.Tensor:
    return torch.tensor([[t.logprob, *t.top.values()] for t in out.logprobs], dtype=torch.float64)


@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
@pytest.mark.parametrize("arch,masks", [
    ("qwen3_moe", [Intervention.mask_experts(0, [0, 1, 2, 3]), Intervention.mask_experts(2, [5, 6])]),
    ("qwen2_moe", [Intervention.mask_experts(0, [1, 2, 3, 4]), Intervention.mask_experts(-1, [0])]),
])
def test_untouched_requests_beside_masked_experts_are_bitwise_in_bf16(model_factory, arch, masks,
                                                                       eager):
    """The prefill (77 tokens: grouped expert GEMMs, router GEMM + routing kernel) and the decode
    steps (4 tokens: GEMV experts, fused router) give the untouched requests the same bits
    whether their neighbour's experts are masked or not."""
    path = model_factory(arch)
    g = torch.Generator().manual_seed(41)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (9, 31, 23, 14)]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=5)
    with LLM(path, device="cuda", dtype="bfloat16", num_kv_blocks=128, block_size=16,
             max_num_seqs=8, enforce_eager=eager, enable_prefix_caching=False) as llm:
        plain = llm.generate(prompts, sp)
        masked = llm.generate(prompts, sp, interventions=[None, masks, None, None])
        other = llm.generate(prompts, sp, interventions=[None, masks[:1], None, None])
    assert _lp(masked[1]).tolist() != _lp(plain[1]).tolist(), "the mask changed nothing"
    for i in (0, 2, 3):
        for run, what in ((masked, "masked"), (other, "other mask")):
            assert run[i].token_ids == plain[i].token_ids, f"request {i}, {what}"
            assert torch.equal(_lp(run[i]), _lp(plain[i])), f"request {i}, {what}: logprob bits"


# ---- the expert kernels: a row's bits depend on that row (Qwen3-30B-A3B shapes, bf16) -----------
E, K, H, I = 128, 8, 2048, 768


@pytest.fixture(scope="module")
def experts():
    g = torch.Generator(device="cuda").manual_seed(11)
    w13 = (torch.randn(E, 2 * I, H, device="cuda", generator=g) / H ** 0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, H, I, device="cuda", generator=g) / I ** 0.5).to(torch.bfloat16)
    return w13, w2


def _tokens(n: int, seed: int):
    """x [n, H] bf16 and router logits [n, E] fp32."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(n, H, device="cuda", generator=g).to(torch.bfloat16)
    return x, torch.randn(n, E, device="cuda", generator=g)


@pytest.mark.parametrize("n", [2, 4, 5, 16, 33, 64, 256, 1024])
def test_expert_rows_ignore_the_other_tokens_routing(experts, n):
    """Every third token loses half the experts (as a neighbour's mask would do): the others'
    rows keep their bits, on whichever path and launch config the dispatcher picks at n."""
    from engine.kernels.moe_configs import pick_config
    from engine.kernels.moe_routing import route
    from engine.layers.moe import fused_experts
    w13, w2 = experts
    x, logits = _tokens(n, seed=n)
    masked = logits.clone()
    masked[1::3, :E // 2] = float("-inf")
    _, w, ids = route(logits, K, True)
    _, w_m, ids_m = route(masked, K, True)
    keep = torch.ones(n, dtype=torch.bool, device="cuda")
    keep[1::3] = False
    assert torch.equal(ids[keep], ids_m[keep]) and not torch.equal(ids[~keep], ids_m[~keep])
    a = fused_experts(x, w13, w2, w, ids)
    b = fused_experts(x, w13, w2, w_m, ids_m)
    cfg = pick_config(n, K, E, I, H, torch.bfloat16, x.device).short()
    assert torch.equal(a[keep], b[keep]), f"n={n}, {cfg}"


def _configs():
    from engine.kernels.moe_configs import KernelTile, MoEKernelConfig, default_gemv, default_grouped
    return {"gemv": default_gemv(2),
            "grouped_bm16": default_grouped(4, K, E),
            "grouped_bm64": default_grouped(512, K, E),
            "grouped_bm128": default_grouped(8192, K, E),
            "grouped_g2": MoEKernelConfig(32, KernelTile(32, 64, 4, 3, 2), KernelTile(64, 64, 4, 3, 2))}


@pytest.mark.parametrize("name", list(_configs()))
def test_one_launch_config_gives_a_token_alone_its_bits_in_the_batch(experts, name):
    """Under one launch config a row's result does not depend on the rows that share its
    tiles or on the batch size: a token alone, or with a few others, has its batch bits.
    (Across configs and paths the summation order differs: the dispatcher picks by the step's
    token count, which a neighbour's routing never changes.)"""
    from engine.kernels.moe_routing import route
    from engine.layers.moe import fused_experts
    cfg = _configs()[name]
    w13, w2 = experts
    x, logits = _tokens(48, seed=5)
    _, w, ids = route(logits, K, True)
    batch = fused_experts(x, w13, w2, w, ids, config=cfg)
    for rows in ([0], [17], [47], [3, 4, 5, 30, 31]):
        got = fused_experts(x[rows], w13, w2, w[rows], ids[rows], config=cfg)
        assert torch.equal(got, batch[rows]), f"{name}: rows {rows}"
