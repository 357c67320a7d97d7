"""Interventions equal HF transformers with forward hooks doing the same edit (fp32, CPU):
greedy tokens and top logprobs for each kind, alone and batched with untouched requests (which
stay bit for bit what they are without it), with chunked prefill, both ways round the prefix
cache, and at TP=2 over gloo."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from engine import LLM, Intervention
from test_generate_vs_hf import NUM_NEW, assert_same_as_hf, greedy_params, random_prompts

LENS = [5, 11, 17]          # 17 > one block of 16; with block_size 4, chunk budget 8: split


# ---- the HF references: hooks doing each edit ---------------------------------------------------
CLAMP_ATTN = "glassbox_clamp_eager"


def clamp_eager_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kw):
    """HF's eager attention, and where `module._clamp = (heads, positions)` is set, those
    heads' scores -inf at every key outside `positions` before the softmax; a query that sees
    none of them gets zeros. query [B, Hq, T, D], key/value [B, Hkv, S, D] (S = positions 0..S-1)."""
    from transformers.models.qwen3.modeling_qwen3 import eager_attention_forward, repeat_kv
    clamp = getattr(module, "_clamp", None)
    if clamp is None:
        return eager_attention_forward(module, query, key, value, attention_mask, scaling,
                                       dropout, **kw)
    heads, positions = clamp
    k = repeat_kv(key, module.num_key_value_groups)
    v = repeat_kv(value, module.num_key_value_groups)
    w = torch.matmul(query, k.transpose(2, 3)) * scaling                  # [B, Hq, T, S]
    T, S = w.shape[-2:]
    q_pos = torch.arange(S - T, S)[:, None]
    causal = torch.arange(S)[None, :] <= q_pos                            # [T, S]
    chosen = torch.zeros(S, dtype=torch.bool)
    chosen[[p for p in positions if p < S]] = True
    allow = torch.ones(w.shape[1], T, S, dtype=torch.bool)
    allow[list(heads)] = causal & chosen
    allow &= causal
    w = w.masked_fill(~allow, float("-inf"))
    p = torch.softmax(w, dim=-1, dtype=torch.float32)
    p = torch.where(allow.any(-1, keepdim=True), p, 0.0).to(query.dtype)  # no key: zeros
    return torch.matmul(p, v).transpose(1, 2).contiguous(), p


class _Unclamp:
    def __init__(self, attn):
        self.attn = attn

    def remove(self):
        del self.attn._clamp


def hf_clamp(hf, layer: int, heads, positions) -> _Unclamp:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask
    AttentionInterface.register(CLAMP_ATTN, clamp_eager_attention)
    AttentionMaskInterface.register(CLAMP_ATTN, eager_mask)     # HF's eager (additive) mask
    hf.set_attn_implementation(CLAMP_ATTN)
    attn = hf.model.layers[layer].self_attn
    attn._clamp = (tuple(heads), tuple(positions))
    return _Unclamp(attn)


def hf_hooks(hf, ivs, P: int) -> list:
    """Register forward hooks on HF modules that apply `ivs` (resolved layers) to a prompt of P
    tokens; returns the handles."""
    handles = []
    layers = hf.model.layers
    for iv in ivs:
        layer = iv.layer % len(layers)
        if iv.kind == "ablate_heads":
            d = hf.config.head_dim

            def pre(mod, args, heads=iv.heads, d=d):
                x = args[0].clone()                          # [B, T, Hq * D]
                for h in heads:
                    x[..., h * d:(h + 1) * d] = 0
                return (x,) + args[1:]
            handles.append(layers[layer].self_attn.o_proj.register_forward_pre_hook(pre))
        elif iv.kind == "mask_experts":
            def route(mod, args, out, experts=iv.experts):
                h = args[0].reshape(-1, mod.hidden_dim)
                logits = F.linear(h, mod.weight)
                logits[:, list(experts)] = float("-inf")
                probs = torch.softmax(logits, dtype=torch.float, dim=-1)
                top, idx = torch.topk(probs, mod.top_k, dim=-1)
                if mod.norm_topk_prob:
                    top = top / top.sum(dim=-1, keepdim=True)
                return logits, top.to(logits.dtype), idx
            handles.append(layers[layer].mlp.gate.register_forward_hook(route))
        elif iv.kind == "clamp_attention":
            handles.append(hf_clamp(hf, layer, iv.heads, iv.key_positions))
        elif iv.kind == "steer":
            v = torch.from_numpy(np.array(iv.vector)) * iv.scale

            def steer(mod, args, kwargs, out, v=v, where=iv.positions):
                pos = kwargs["position_ids"][0]              # [T]
                on = {"all": torch.ones_like(pos, dtype=torch.bool), "prompt": pos < P,
                      "generated": pos >= P}[where]
                return out + on[None, :, None] * v
            handles.append(layers[layer].register_forward_hook(steer, with_kwargs=True))
    return handles


def hf_greedy_with(path: str, prompts, ivs_per_prompt, n: int = NUM_NEW):
    from tiny_models import load_hf
    hf = load_hf(path)
    hf.generation_config.eos_token_id = None
    out = []
    for p, ivs in zip(prompts, ivs_per_prompt):
        handles = hf_hooks(hf, ivs or (), len(p))
        try:
            with torch.no_grad():
                ids = torch.tensor([p])     # an explicit mask: a token 0 is not padding
                r = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                                output_logits=True, return_dict_in_generate=True, pad_token_id=0)
        finally:
            for h in handles:
                h.remove()
        out.append((r.sequences[0, len(p):].tolist(),
                    torch.log_softmax(torch.cat(r.logits).float(), dim=-1)))
    return out


def assert_identical(a, b) -> None:
    """Bit for bit: the same tokens and the same logprob floats."""
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids
        assert [(t.logprob, t.top) for t in x.logprobs] == [(t.logprob, t.top) for t in y.logprobs]


def steer_vec(hidden: int, seed: int) -> np.ndarray:
    return torch.randn(hidden, generator=torch.Generator().manual_seed(seed)).numpy()


@pytest.fixture(scope="module")
def dense(model_factory):
    return model_factory("qwen3"), random_prompts(LENS, seed=77)


@pytest.fixture(scope="module")
def moe(model_factory):
    return model_factory("qwen3_moe"), random_prompts(LENS, seed=78)


def _kinds(hidden: int):
    return {
        "ablate": [Intervention.ablate_heads(1, [0, 3])],
        "ablate_neg_layer": [Intervention.ablate_heads(-1, [2])],
        "steer_all": [Intervention.steer(0, steer_vec(hidden, 1), scale=2.0)],
        "steer_prompt": [Intervention.steer(1, steer_vec(hidden, 2), 3.0, positions="prompt")],
        "steer_generated": [Intervention.steer(2, steer_vec(hidden, 3), 3.0, "generated")],
        "mixed": [Intervention.ablate_heads(0, [1]), Intervention.steer(1, steer_vec(hidden, 4), 1.5)],
        # prompt 1 has 11 tokens: queries 0..2 see only key 0, later ones 0, 3 and 7
        "clamp": [Intervention.clamp_attention(1, [0, 2], [0, 3, 7])],
        # queries before position 4 see no chosen key (zeros); 12 is the 2nd generated token
        "clamp_late_keys": [Intervention.clamp_attention(-1, [3], [4, 12])],
        "clamp_mixed": [Intervention.clamp_attention(0, [1], [1, 2, 9]),
                        Intervention.ablate_heads(0, [3]), Intervention.steer(1, steer_vec(hidden, 6), 1.0)],
    }


# ---- each kind alone, and batched with untouched requests ----------------------------------------
@pytest.mark.parametrize("kind", ["ablate", "ablate_neg_layer", "steer_all", "steer_prompt",
                                  "steer_generated", "mixed", "clamp", "clamp_late_keys",
                                  "clamp_mixed"])
def test_dense_intervention_matches_hf_hooks_and_spares_the_batch(dense, kind):
    path, prompts = dense
    ivs = _kinds(64)[kind]
    per = [None, ivs, None]                  # the middle request is intervened, its neighbours not
    # no prefix cache: the untouched requests of both runs must compute the very same steps
    with LLM(path, device="cpu", enable_prefix_caching=False) as llm:
        plain = llm.generate(prompts, greedy_params())
        got = llm.generate(prompts, greedy_params(), interventions=per)
        batched = llm.inspect().steps[-2]
    assert len(batched.entries) == len(prompts), "the requests were not batched together"
    ref = hf_greedy_with(path, prompts[1:2], [ivs])
    assert_same_as_hf(got[1:2], ref)
    assert got[1].token_ids != plain[1].token_ids or got[1].logprobs[0].logprob != \
        plain[1].logprobs[0].logprob, "the intervention changed nothing: the test proves nothing"
    assert_identical([got[0], got[2]], [plain[0], plain[2]])


def test_moe_mask_experts_matches_hf_and_spares_the_batch(moe):
    path, prompts = moe
    ivs = [Intervention.mask_experts(0, [0, 1, 2]), Intervention.mask_experts(-1, [5])]
    with LLM(path, device="cpu", enable_prefix_caching=False) as llm:
        plain = llm.generate(prompts, greedy_params())
        got = llm.generate(prompts, greedy_params(), interventions=[ivs, None, ivs])
    ref = hf_greedy_with(path, [prompts[0], prompts[2]], [ivs, ivs])
    assert_same_as_hf([got[0], got[2]], ref)
    assert got[0].token_ids != plain[0].token_ids or got[0].logprobs[0].logprob != \
        plain[0].logprobs[0].logprob
    # the untouched request: bit for bit (each token's expert output is its own: moe_cpu.py)
    assert_identical([got[1]], [plain[1]])


def test_masked_experts_are_never_routed_to(moe):
    from engine import ProbeSpec
    path, prompts = moe
    with LLM(path, device="cpu") as llm:
        out = llm.generate(prompts[2], greedy_params(), watch=ProbeSpec(),
                           interventions=[Intervention.mask_experts(1, [3, 4])])
        tr = llm.trace(out[0].request_id)
    _, ids, _ = tr.routing()                                # [T, moe_layers, k]
    j = tr.moe_layers.index(1)
    assert not np.isin(ids[:, j], [3, 4]).any()


# ---- chunked prefill, prefix caching, TP ---------------------------------------------------------
def test_chunked_prefill_with_interventions_matches_hf(dense):
    path, prompts = dense
    ivs = _kinds(64)["mixed"] + [Intervention.steer(2, steer_vec(64, 9), 2.0, "prompt"),
                                 Intervention.clamp_attention(2, [0, 1], [0, 5, 9, 14])]
    with LLM(path, device="cpu", block_size=4, max_num_batched_tokens=8) as llm:
        got = llm.generate(prompts, greedy_params(), interventions=ivs)
        steps = llm.inspect().steps
    assert any(e.kind == "prefill" and e.start_pos > 0 for s in steps for e in s.entries)
    assert_same_as_hf(got, hf_greedy_with(path, prompts, [ivs] * 3))


def test_prefix_cache_never_crosses_an_intervention(dense):
    """A prefix computed without an intervention is not reused by a request with one, nor the
    other way round; the same intervention again does hit."""
    path, prompts = dense
    ivs = _kinds(64)["ablate"]
    ref_iv = hf_greedy_with(path, prompts, [ivs] * 3)
    ref_plain = hf_greedy_with(path, prompts, [None] * 3)
    with LLM(path, device="cpu", block_size=4) as llm:
        def hits():
            return llm.inspect().prefix_hits
        assert_same_as_hf(llm.generate(prompts, greedy_params()), ref_plain)
        h0 = hits()
        assert_same_as_hf(llm.generate(prompts, greedy_params(), interventions=ivs), ref_iv)
        assert hits() == h0, "an intervened request reused blocks computed without it"
        assert_same_as_hf(llm.generate(prompts, greedy_params(), interventions=ivs), ref_iv)
        h1 = hits()
        assert h1 > h0, "the same intervention should reuse its own prefix"
        assert_same_as_hf(llm.generate(prompts, greedy_params()), ref_plain)
        other = [Intervention.ablate_heads(1, [0])]
        llm.generate(prompts, greedy_params(), interventions=other)
        assert hits() - h1 == sum((n - 1) // 4 for n in LENS), \
            "only the plain rerun may hit; another intervention must not"


def test_tp2_interventions_equal_tp1(dense, moe):
    for path, prompts, ivs in [
            (dense[0], dense[1], _kinds(64)["mixed"] + [Intervention.ablate_heads(2, [1, 2]),
                                                        Intervention.clamp_attention(1, [1, 2], [0, 2, 6])]),
            (moe[0], moe[1], [Intervention.mask_experts(1, [0, 7]),
                              Intervention.ablate_heads(0, [3])])]:
        runs, vectors = [], []
        for tp in (1, 2):
            with LLM(path, device="cpu", tensor_parallel_size=tp, block_size=4,
                     num_kv_blocks=48) as llm:
                runs.append(llm.generate(prompts, greedy_params(), interventions=[ivs, None, ivs]))
                vectors.append(llm.steering_vector(1, prompts[0], prompts[2]))
        torch.testing.assert_close(vectors[1], vectors[0], atol=1e-5, rtol=1e-5)
        ref = hf_greedy_with(path, [prompts[0], prompts[2]], [ivs, ivs])
        assert_same_as_hf([runs[1][0], runs[1][2]], ref)
        for a, b in zip(*runs):
            assert a.token_ids == b.token_ids
            np.testing.assert_allclose([x.logprob for x in a.logprobs],
                                       [x.logprob for x in b.logprobs], atol=1e-4)


# ---- steering vectors ----------------------------------------------------------------------------
def test_steering_vector_is_the_mean_residual_difference(dense):
    from tiny_models import load_hf
    path, prompts = dense
    layer = 1
    with LLM(path, device="cpu", block_size=4, max_num_batched_tokens=8) as llm:
        llm.generate(prompts[2], greedy_params())          # cached blocks must not be skipped
        v = llm.steering_vector(layer, prompts[2], prompts[1])
        v_neg = llm.steering_vector(layer - 3, prompts[2], prompts[1])
    hf = load_hf(path)
    with torch.no_grad():
        means = [hf(torch.tensor([p]), output_hidden_states=True).hidden_states[layer + 1][0]
                 .mean(0) for p in (prompts[2], prompts[1])]
    assert v.shape == (64,) and v.dtype == torch.float32
    torch.testing.assert_close(v, means[0] - means[1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(v_neg, v, atol=0, rtol=0)


def test_preempted_intervened_requests_recompute_to_hf(dense):
    """Preemption drops the blocks and recomputes prompt + generated tokens as one prefill: the
    generated positions keep their "generated" steering."""
    path, prompts = dense
    ivs = [Intervention.steer(1, steer_vec(64, 5), 3.0, "generated"),
           Intervention.ablate_heads(2, [0])]
    with LLM(path, device="cpu", block_size=4, num_kv_blocks=10) as llm:
        got = llm.generate(prompts, greedy_params(), interventions=[ivs, None, ivs])
        assert llm.inspect().preemptions > 0
    ref = hf_greedy_with(path, prompts, [ivs, None, ivs])
    assert_same_as_hf(got, ref)
