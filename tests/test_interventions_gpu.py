"""Interventions on the GPU: decode steps with an intervened request replay a CUDA-graph variant
(tables refilled each replay) and give the tokens of the CPU path and of eager GPU steps; the
untouched requests of the batch keep the tokens they have without it; the fused router kernel
masks experts."""
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
