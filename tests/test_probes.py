"""Introspection probes against HF transformers (eager, fp32): residual norms, logit lens,
attention rows rebuilt from the paged K cache, prefill patterns, MoE routing; and the probe
contract: per request, never changing outputs, surviving preemption, exportable."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engine import LLM, ProbeSpec, RequestTrace, SamplingParams
from tiny_models import load_hf

BLOCK = 4          # small blocks so short contexts cross several block boundaries
RTOL = 1e-4


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def prompt(seed: int, n: int) -> list[int]:
    """Random token ids above the special tokens (0..2), so no prompt ends early."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 200, (n,), generator=g).tolist()


# ---- HF reference --------------------------------------------------------------------------------
@torch.no_grad()
def hf_run(hf, ids: list[int]) -> dict:
    """HF eager forward over ids with hooks: residual stream [L + 1, T, H] (0 = embeddings,
    l + 1 = output of decoder layer l), attention [L, Hq, T, T], router logits / top-k /
    shared-expert gate per MoE layer."""
    got: dict = {"router": {}, "shared": {}}
    hooks = []

    def keep(key):
        def hook(mod, inp, out):
            got[key] = out[0] if isinstance(out, tuple) else out
        return hook

    def keep_router(layer):
        def hook(mod, inp, out):   # transformers 5 routers return (logits, scores, indices)
            got["router"][layer] = tuple(o.detach().clone() for o in out)
        return hook

    def keep_shared(layer):
        def hook(mod, inp, out):
            got["shared"][layer] = torch.sigmoid(out).reshape(-1)
        return hook

    hooks.append(hf.model.embed_tokens.register_forward_hook(keep(0)))
    for l, layer in enumerate(hf.model.layers):
        hooks.append(layer.register_forward_hook(keep(l + 1)))
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None:
            hooks.append(gate.register_forward_hook(keep_router(l)))
        if getattr(layer.mlp, "shared_expert_gate", None) is not None:
            hooks.append(layer.mlp.shared_expert_gate.register_forward_hook(keep_shared(l)))
    try:
        out = hf(torch.tensor([ids]), output_attentions=True)
    finally:
        for h in hooks:
            h.remove()
    L = len(hf.model.layers)
    resid = torch.stack([got[i][0] for i in range(L + 1)])          # [L + 1, T, H]
    attn = torch.stack([a[0] for a in out.attentions])              # [L, Hq, T, T]
    return {"resid": resid, "attn": attn, "router": got["router"], "shared": got["shared"]}


@torch.no_grad()
def hf_lens(hf, resid: torch.Tensor, pos: int) -> torch.Tensor:
    """Every layer's residual at pos through HF's final norm + LM head: probs [L, V]."""
    x = hf.model.norm(resid[1:, pos])                               # [L, H]
    return torch.softmax(hf.lm_head(x).float(), dim=-1)


def processed(trace: RequestTrace) -> list[int]:
    """Tokens whose K/V the engine computed: prompt + output, except the newest token."""
    return (trace.prompt_token_ids + trace.output_token_ids)[:-1]


def assert_norms_match(trace: RequestTrace, ref: dict, rows=None) -> None:
    want = ref["resid"].norm(dim=-1).T.numpy()                      # [T, L + 1]
    got = trace.norms()
    assert got.shape == want.shape
    rows = slice(None) if rows is None else rows
    np.testing.assert_allclose(got[rows], want[rows], rtol=RTOL, atol=1e-6)


def assert_attention_matches(trace: RequestTrace, ref: dict, num_outputs: int) -> None:
    assert len(trace.attention) == num_outputs
    first = len(trace.prompt_token_ids) - 1
    for i, step in enumerate(trace.attention):
        pos = first + i
        assert step.position == pos
        want = ref["attn"][step.layers, :, pos, :pos + 1].numpy()    # [layers, Hq, pos + 1]
        assert step.probs.shape == want.shape
        np.testing.assert_allclose(step.probs, want, rtol=RTOL, atol=1e-6)


# ---- fixtures ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def dense_dir(model_factory):
    return model_factory("qwen3")        # 4 query heads, 2 KV heads: GQA


@pytest.fixture(scope="module")
def hf_dense(dense_dir):
    return load_hf(dense_dir)


@pytest.fixture(scope="module")
def llm(dense_dir):
    engine = LLM(dense_dir, device="cpu", block_size=BLOCK, num_kv_blocks=96,
                 max_num_batched_tokens=32)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def watched(llm, hf_dense):
    """One watched greedy request: prompt of 6 tokens, 9 new ones (contexts 6..14 cross
    three block boundaries), with the prompt pattern of layers 0 and 1."""
    p = prompt(1, 6)
    out = llm.generate([p], greedy(9), watch=ProbeSpec(prefill_pattern_layers=(0, 1)))[0]
    trace = llm.trace(out.request_id)
    return out, trace, hf_run(hf_dense, processed(trace))


# ---- norms, lens, attention (dense) ----------------------------------------------------------------
def test_trace_records_prompt_and_outputs(watched):
    out, trace, _ = watched
    assert trace.finished
    assert trace.prompt_token_ids == out.prompt_token_ids
    assert trace.output_token_ids == out.token_ids
    assert len(trace.token_texts) == len(out.prompt_token_ids) + len(out.token_ids)


def test_norms_match_hf_residual_stream(watched):
    out, trace, ref = watched
    assert trace.norms().shape == (len(out.prompt_token_ids) + len(out.token_ids) - 1,
                                   trace.num_layers + 1)
    assert_norms_match(trace, ref)


def test_engine_greedy_tokens_match_hf(watched, hf_dense):
    out, trace, ref = watched
    # the reference is only meaningful if HF would have produced the same continuation
    last = hf_dense.lm_head(hf_dense.model.norm(ref["resid"][-1]))   # [T, V]
    P = len(out.prompt_token_ids)
    assert last[P - 1:].argmax(-1).tolist() == out.token_ids


def test_logit_lens_matches_hf_final_norm_and_head(watched, hf_dense):
    out, trace, ref = watched
    P = len(out.prompt_token_ids)
    assert len(trace.lens) == len(out.token_ids)
    for i, step in enumerate(trace.lens):
        pos = P - 1 + i
        assert step.position == pos and step.sampled_token == out.token_ids[i]
        probs = hf_lens(hf_dense, ref["resid"], pos)                # [L, V]
        k = step.top_ids.shape[1]
        top_p, top_i = probs.topk(k, dim=-1)
        np.testing.assert_array_equal(step.top_ids, top_i.numpy())
        np.testing.assert_allclose(step.top_probs, top_p.numpy(), rtol=RTOL, atol=1e-6)
        tok = step.sampled_token
        p_tok = probs[:, tok]
        np.testing.assert_allclose(step.sampled_prob, p_tok.numpy(), rtol=RTOL, atol=1e-7)
        np.testing.assert_array_equal(step.sampled_rank, (probs > p_tok[:, None]).sum(-1).numpy())
        ent = -(probs * probs.clamp_min(1e-30).log()).sum(-1)
        np.testing.assert_allclose(step.entropy, ent.numpy(), rtol=RTOL)
        # the last layer's lens is the model's own prediction: greedy picks its top token
        assert step.sampled_rank[-1] == 0


def test_the_lens_takes_the_same_rows_copied_per_layer_or_stacked_once(llm, watched,
                                                                       monkeypatch):
    """Small steps keep each hook's residual and take the lens' rows in one launch at the end;
    big ones copy a row per layer (probes/buffers.py STACK_RESID_ROWS): the same lens."""
    import engine.probes.buffers as pb
    out, trace, _ = watched
    monkeypatch.setattr(pb, "STACK_RESID_ROWS", 0)          # every step copies per layer
    again = llm.generate([out.prompt_token_ids], greedy(len(out.token_ids)),
                         watch=ProbeSpec(prefill_pattern_layers=(0, 1)))[0]
    assert again.token_ids == out.token_ids
    # the repeat hits the prefix cache: its prefill is shorter, so fp32 sums round differently
    for a, b in zip(trace.lens, llm.trace(again.request_id).lens, strict=True):
        np.testing.assert_array_equal(a.top_ids, b.top_ids)
        np.testing.assert_allclose(a.top_probs, b.top_probs, rtol=1e-5)
        np.testing.assert_allclose(a.entropy, b.entropy, rtol=1e-5)


def test_attention_rows_match_hf_eager_across_block_boundaries(watched):
    out, trace, ref = watched
    assert_attention_matches(trace, ref, len(out.token_ids))
    for step in trace.attention:
        assert step.layers == list(range(trace.num_layers))
        assert len(step.block_table) == step.position // BLOCK + 1


def test_prefill_pattern_matches_hf_full_attention(watched):
    out, trace, ref = watched
    P = len(out.prompt_token_ids)
    assert sorted(trace.prefill_pattern) == [0, 1]
    for layer, pat in trace.prefill_pattern.items():
        np.testing.assert_allclose(pat, ref["attn"][layer, :, :P, :P].numpy(),
                                   rtol=RTOL, atol=1e-6)


def test_prefill_pattern_is_recorded_across_chunks(dense_dir, hf_dense):
    """A prompt prefilled in several chunks (8-token budget) still gets its whole pattern."""
    with LLM(dense_dir, device="cpu", block_size=BLOCK, num_kv_blocks=64,
             max_num_batched_tokens=8) as eng:
        p = prompt(61, 21)
        out = eng.generate([p], greedy(3), watch=ProbeSpec(prefill_pattern_layers=(0, 2)))[0]
        tr = eng.trace(out.request_id)
    ref = hf_run(hf_dense, processed(tr))
    assert tr.prefill_computed is not None and tr.prefill_computed.all()
    for layer in (0, 2):
        np.testing.assert_allclose(tr.prefill_pattern[layer], ref["attn"][layer, :, :21, :21],
                                   rtol=RTOL, atol=1e-6)


def test_prefill_pattern_after_a_prefix_hit_marks_cached_rows(dense_dir, hf_dense):
    with LLM(dense_dir, device="cpu", block_size=BLOCK, num_kv_blocks=64) as eng:
        shared = prompt(62, 12)                     # 3 full blocks are cacheable
        eng.generate([shared + prompt(63, 2)], greedy(1))
        hit = eng.generate([shared + prompt(64, 5)], greedy(2),
                           watch=ProbeSpec(prefill_pattern_layers=(1,)))[0]
        tr = eng.trace(hit.request_id)
    assert hit.metrics["prefix_cached_blocks"] == 3
    cached, P = 3 * BLOCK, 17
    np.testing.assert_array_equal(tr.prefill_computed, np.arange(P) >= cached)
    pat = tr.prefill_pattern[1]
    assert pat.shape[1:] == (P, P)
    assert np.isnan(pat[:, :cached]).all()          # never computed here: said, not guessed
    ref = hf_run(hf_dense, processed(tr))
    np.testing.assert_allclose(pat[:, cached:], ref["attn"][1, :, cached:P, :P],
                               rtol=RTOL, atol=1e-6)


def test_prefill_pattern_keeps_the_prompts_shape_after_preemption(dense_dir, hf_dense):
    with LLM(dense_dir, device="cpu", block_size=BLOCK, num_kv_blocks=12) as eng:
        specs = [None, None, ProbeSpec(prefill_pattern_layers=(0,))]   # the youngest is evicted
        outs = eng.generate([prompt(20, 10), prompt(21, 10), prompt(22, 10)], greedy(12),
                            watch=specs)
        assert outs[2].metrics["preemptions"] > 0
        tr = eng.trace(outs[2].request_id)
    ref = hf_run(hf_dense, processed(tr))
    assert tr.prefill_pattern[0].shape == (4, 10, 10)
    np.testing.assert_allclose(tr.prefill_pattern[0], ref["attn"][0, :, :10, :10],
                               rtol=RTOL, atol=1e-6)


def test_block_mass_sums_to_one_and_equals_block_slices(watched):
    _, trace, _ = watched
    for step in trace.attention:
        mass = step.block_mass()                    # [layers, Hq, num_blocks]
        n = len(step.block_table)
        assert mass.shape == (*step.probs.shape[:2], n)
        np.testing.assert_allclose(mass.sum(-1), 1.0, rtol=1e-5)
        for b in range(n):
            want = step.probs[..., b * BLOCK:(b + 1) * BLOCK].sum(-1)
            np.testing.assert_allclose(mass[..., b], want, rtol=1e-6, atol=1e-7)


def test_attention_matches_hf_after_prefix_cache_hit(llm, hf_dense):
    shared = prompt(2, 10)                          # 2 full blocks of 4 are cacheable
    llm.generate([shared + prompt(3, 3)], greedy(2))
    out = llm.generate([shared + prompt(4, 3)], greedy(6), watch=ProbeSpec())[0]
    assert out.metrics["prefix_cached_blocks"] == 2
    trace = llm.trace(out.request_id)
    ref = hf_run(hf_dense, processed(trace))
    assert_attention_matches(trace, ref, len(out.token_ids))
    # cached positions were never computed by this request: marked unknown, not invented
    assert np.isnan(trace.norms()[:2 * BLOCK]).all()
    assert_norms_match(trace, ref, rows=slice(2 * BLOCK, None))


def test_chunked_prefill_norms_and_lens_match_hf(llm, hf_dense):
    # 45 tokens with a budget of 32 per step: the prompt is computed in two chunks
    out = llm.generate([prompt(5, 45)], greedy(3), watch=ProbeSpec())[0]
    trace = llm.trace(out.request_id)
    ref = hf_run(hf_dense, processed(trace))
    assert_norms_match(trace, ref)
    assert_attention_matches(trace, ref, len(out.token_ids))
    assert [s.position for s in trace.lens] == [44, 45, 46]


# ---- batches of watched and unwatched requests ---------------------------------------------------
def test_each_watched_request_in_a_batch_matches_hf(llm, hf_dense):
    specs = [ProbeSpec(layers=(0,), prefill_pattern_layers=(0,), lens_top_k=3), None,
             ProbeSpec(layers=(1, 2), prefill_pattern_layers=(0, 2))]
    prompts = [prompt(6, 7), prompt(7, 5), prompt(8, 9)]
    outs = llm.generate(prompts, greedy(5), watch=specs)
    with pytest.raises(KeyError, match="never watched"):
        llm.trace(outs[1].request_id)
    for out, spec in ((outs[0], specs[0]), (outs[2], specs[2])):
        trace = llm.trace(out.request_id)
        ref = hf_run(hf_dense, processed(trace))
        assert_norms_match(trace, ref)
        assert_attention_matches(trace, ref, len(out.token_ids))
        assert all(s.layers == list(spec.layers) for s in trace.attention)
        assert all(s.top_ids.shape == (trace.num_layers, spec.lens_top_k) for s in trace.lens)
        P = len(out.prompt_token_ids)
        assert sorted(trace.prefill_pattern) == sorted(spec.prefill_pattern_layers)
        for layer, pat in trace.prefill_pattern.items():
            np.testing.assert_allclose(pat, ref["attn"][layer, :, :P, :P].numpy(),
                                       rtol=RTOL, atol=1e-6)


def test_probes_do_not_change_outputs(dense_dir):
    # no prefix cache, so both runs compute exactly the same positions
    with LLM(dense_dir, device="cpu", block_size=BLOCK, num_kv_blocks=64,
             enable_prefix_caching=False) as engine:
        prompts = [prompt(10, 7), prompt(11, 12), prompt(12, 4)]
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)
        off = engine.generate(prompts, params)
        on = engine.generate(prompts, params,
                             watch=[ProbeSpec(prefill_pattern_layers=(0,)), None, None])
    for a, b in zip(off, on):
        assert a.token_ids == b.token_ids
        np.testing.assert_allclose([lp.logprob for lp in a.logprobs],
                                   [lp.logprob for lp in b.logprobs], rtol=1e-5, atol=1e-6)


def test_attention_rows_in_a_trace_equal_hf_and_are_read_only(llm, hf_dense):
    """The trace holds HF's attention rows, one step per generated token, as host arrays that
    no reader can write into (a frozen trace shares them with the engine's own)."""
    spec = ProbeSpec(norms=False, logit_lens=False, routing=False)
    out = llm.generate([prompt(7, 9)], greedy(6), watch=spec)[0]
    tr = llm.trace(out.request_id)
    assert len(tr.attention) == 6 and all(st.on_host for st in tr.attention)
    assert_attention_matches(tr, hf_run(hf_dense, processed(tr)), len(out.token_ids))
    with pytest.raises(ValueError):
        tr.attention[0].probs[0, 0, 0] = 1.0


def test_the_attention_store_moves_the_oldest_rows_past_its_budget_and_keeps_their_values():
    """Rows left where the step wrote them (a tensor) move to the host in the store's own
    thread once the held bytes pass the budget, oldest first, with the same values; a reader
    that uses a row first moves just that one."""
    import time as _time
    from engine.probes.attention_store import AttentionStore
    from engine.probes.trace import AttentionStep
    g = torch.Generator().manual_seed(11)
    rows = [torch.rand(3, 4, p + 1, generator=g) for p in range(20)]
    steps = [AttentionStep(p, [0, 1, 2], r.clone(), [0], 16) for p, r in enumerate(rows)]
    one = 3 * 4 * 20 * 4
    store = AttentionStore(budget_bytes=8 * one, chunk_bytes=one)
    read_first = steps[15].probs                # a reader moved this one itself
    np.testing.assert_array_equal(read_first, rows[15].numpy())
    for st in steps:
        store.add("r", st)
    deadline = _time.monotonic() + 10
    while store.device_bytes > store.budget_bytes and _time.monotonic() < deadline:
        _time.sleep(0.01)
    assert store.device_bytes <= store.budget_bytes and store.spills >= 1
    assert steps[0].on_host and not steps[-1].on_host     # the oldest went first
    store.flush()
    assert all(st.on_host for st in steps) and store.device_bytes == 0
    for st, r in zip(steps, rows):
        np.testing.assert_array_equal(st.probs, r.numpy())


def test_unwatched_request_has_no_trace(llm):
    out = llm.generate([prompt(13, 5)], greedy(2))[0]
    with pytest.raises(KeyError, match="never watched"):
        llm.trace(out.request_id)
    off = llm.generate([prompt(14, 5)], greedy(2),
                       watch=ProbeSpec(norms=False, logit_lens=False, attention=False,
                                       routing=False))[0]
    with pytest.raises(KeyError, match="never watched"):
        llm.trace(off.request_id)


def test_an_evicted_trace_says_so_and_names_the_setting(dense_dir):
    with LLM(dense_dir, device="cpu", block_size=BLOCK, num_kv_blocks=64, max_traces=2) as eng:
        outs = [eng.generate([prompt(30 + i, 5)], greedy(2), watch=ProbeSpec())[0]
                for i in range(3)]
        assert eng.traced_requests() == [outs[2].request_id, outs[1].request_id]
        with pytest.raises(KeyError, match="evicted.*max_traces"):
            eng.trace(outs[0].request_id)
        assert eng.trace(outs[2].request_id).request_id == outs[2].request_id


def test_probe_spec_flags_are_respected(llm, hf_dense):
    p = prompt(15, 6)
    no_norms = llm.generate([p], greedy(3), watch=ProbeSpec(norms=False))[0]
    t = llm.trace(no_norms.request_id)
    assert t.norms().shape == (0, t.num_layers + 1)
    assert len(t.lens) == 3 and len(t.attention) == 3
    only_norms = llm.generate([prompt(16, 6)], greedy(3),
                              watch=ProbeSpec(logit_lens=False, attention=False))[0]
    t = llm.trace(only_norms.request_id)
    assert t.lens == [] and t.attention == [] and t.prefill_pattern == {}
    assert_norms_match(t, hf_run(hf_dense, processed(t)))
    assert t.router_probs == []            # a dense model has no routing


# ---- preemption ----------------------------------------------------------------------------------
def test_preempted_watched_request_keeps_one_norm_row_per_position(dense_dir, hf_dense):
    # 12 blocks of 4 tokens; three requests growing to 22 tokens each cannot all fit
    with LLM(dense_dir, device="cpu", block_size=BLOCK, num_kv_blocks=12) as engine:
        specs = [None, None, ProbeSpec(prefill_pattern_layers=(0,))]   # the youngest is evicted
        outs = engine.generate([prompt(20, 10), prompt(21, 10), prompt(22, 10)], greedy(12),
                               watch=specs)
        assert engine.inspect().preemptions > 0
    out = outs[2]
    assert out.metrics["preemptions"] > 0
    trace = engine.trace(out.request_id)
    n = len(out.prompt_token_ids) + len(out.token_ids) - 1
    assert trace.norms().shape == (n, trace.num_layers + 1)
    assert not np.isnan(trace.norms()).any()
    ref = hf_run(hf_dense, processed(trace))
    assert_norms_match(trace, ref)
    assert [s.position for s in trace.lens] == list(range(9, 9 + len(out.token_ids)))
    assert_attention_matches(trace, ref, len(out.token_ids))


# ---- MoE routing -------------------------------------------------------------------------------
MOE = {"qwen3_moe": [0, 1, 2], "qwen2_moe": [0, 2]}     # qwen2_moe: layer 1 is in mlp_only_layers


@pytest.fixture(scope="module", params=sorted(MOE))
def moe(request, model_factory):
    path = model_factory(request.param)
    engine = LLM(path, device="cpu", block_size=BLOCK, num_kv_blocks=64)
    engine.probes.record_expert_load = True
    hf = load_hf(path)
    out = engine.generate([prompt(30, 7), prompt(31, 5)], greedy(5),
                          watch=[ProbeSpec(), None])[0]
    trace = engine.trace(out.request_id)
    yield request.param, engine, hf, out, trace, hf_run(hf, processed(trace))
    engine.shutdown()


def test_routing_matches_hf_router(moe):
    arch, engine, hf, out, trace, ref = moe
    layers = MOE[arch]
    assert trace.moe_layers == layers
    probs, ids, weights = trace.routing()                   # [T, moe_layers, E|k]
    T = len(processed(trace))
    cfg = hf.config
    assert probs.shape == (T, len(layers), cfg.num_experts)
    assert ids.shape == weights.shape == (T, len(layers), cfg.num_experts_per_tok)
    for j, layer in enumerate(layers):
        logits, scores, indices = ref["router"][layer]
        np.testing.assert_allclose(probs[:, j], torch.softmax(logits.float(), -1).numpy(),
                                   rtol=RTOL, atol=1e-6)
        np.testing.assert_array_equal(ids[:, j], indices.numpy())
        np.testing.assert_allclose(weights[:, j], scores.float().numpy(), rtol=RTOL, atol=1e-6)
    assert set(ref["router"]) == set(layers)                # HF agrees which layers route


def test_shared_expert_gate_matches_hf_sigmoid(moe):
    arch, engine, hf, out, trace, ref = moe
    if arch != "qwen2_moe":
        assert trace.shared_expert_gate == []               # Qwen3-MoE has no shared expert
        return
    gate = np.stack(trace.shared_expert_gate)               # [T, moe_layers]
    for j, layer in enumerate(MOE[arch]):
        np.testing.assert_allclose(gate[:, j], ref["shared"][layer].numpy(), rtol=RTOL, atol=1e-6)


def test_routing_after_prefix_cache_hit_leaves_cached_rows_unknown(moe):
    arch, engine, hf, out, trace, ref = moe
    shared = prompt(33, 9)                          # 2 full blocks of 4 are cacheable
    engine.generate([shared + prompt(34, 2)], greedy(1))
    hit = engine.generate([shared + prompt(35, 3)], greedy(3), watch=ProbeSpec())[0]
    assert hit.metrics["prefix_cached_blocks"] == 2
    t = engine.trace(hit.request_id)
    probs, ids, weights = t.routing()
    cached = 2 * BLOCK
    # never computed by this request: unknown, not borrowed from a neighbouring token
    assert np.isnan(probs[:cached]).all() and np.isnan(weights[:cached]).all()
    assert (ids[:cached] == -1).all()
    r = hf_run(hf, processed(t))
    for j, layer in enumerate(MOE[arch]):
        logits, scores, indices = r["router"][layer]
        np.testing.assert_allclose(probs[cached:, j],
                                   torch.softmax(logits.float(), -1)[cached:].numpy(),
                                   rtol=RTOL, atol=1e-6)
        np.testing.assert_array_equal(ids[cached:, j], indices[cached:].numpy())


def test_big_steps_select_routing_rows_and_still_match_hf(moe, monkeypatch):
    """Steps with more rows than STACK_ROUTING_ROWS record routing by selecting the watched
    rows per layer instead of through the router's stacked buffers: still HF's routing."""
    import engine.probes.buffers as probes_mod
    arch, engine, hf, out, trace, ref = moe
    monkeypatch.setattr(probes_mod, "STACK_ROUTING_ROWS", 0)
    res = engine.generate([prompt(40, 7), prompt(41, 5)], greedy(4), watch=[ProbeSpec(), None])
    t = engine.trace(res[0].request_id)
    r = hf_run(hf, processed(t))
    probs, ids, weights = t.routing()
    for j, layer in enumerate(MOE[arch]):
        logits, scores, indices = r["router"][layer]
        np.testing.assert_allclose(probs[:, j], torch.softmax(logits.float(), -1).numpy(),
                                   rtol=RTOL, atol=1e-6)
        np.testing.assert_array_equal(ids[:, j], indices.numpy())
        np.testing.assert_allclose(weights[:, j], scores.float().numpy(), rtol=RTOL, atol=1e-6)
        if arch == "qwen2_moe":
            np.testing.assert_allclose(np.stack(t.shared_expert_gate)[:, j],
                                       r["shared"][layer].numpy(), rtol=RTOL, atol=1e-6)
    k = hf.config.num_experts_per_tok
    for st in engine.inspect().steps[-4:]:
        np.testing.assert_array_equal(st.expert_load.sum(-1),
                                      (st.num_prefill_tokens + st.num_decode_tokens) * k)


def test_moe_norms_and_attention_match_hf(moe):
    arch, engine, hf, out, trace, ref = moe
    assert_norms_match(trace, ref)
    assert_attention_matches(trace, ref, len(out.token_ids))


def test_expert_load_sums_to_tokens_times_top_k(moe):
    arch, engine, hf, out, trace, ref = moe
    k, E = hf.config.num_experts_per_tok, hf.config.num_experts
    steps = engine.inspect().steps
    assert steps
    for st in steps:
        assert st.expert_load is not None and st.expert_load.shape == (len(MOE[arch]), E)
        n = st.num_prefill_tokens + st.num_decode_tokens
        np.testing.assert_array_equal(st.expert_load.sum(-1), n * k)
    # and it is this step's load, not a stale copy: turned off, steps carry none
    engine.probes.record_expert_load = False
    engine.generate([prompt(32, 4)], greedy(2))
    assert engine.inspect().steps[-1].expert_load is None
    engine.probes.record_expert_load = True


# ---- export ----------------------------------------------------------------------------------------
def assert_traces_equal(a: RequestTrace, b: RequestTrace) -> None:
    aa, bb = a.to_arrays(), b.to_arrays()
    assert sorted(aa) == sorted(bb)
    for key in aa:
        np.testing.assert_array_equal(aa[key], bb[key], err_msg=key)
    assert (a.request_id, a.num_layers, a.prompt_token_ids, a.output_token_ids, a.token_texts,
            a.moe_layers) == (b.request_id, b.num_layers, b.prompt_token_ids,
                              b.output_token_ids, b.token_texts, b.moe_layers)
    assert [(s.position, s.sampled_token) for s in a.lens] == \
        [(s.position, s.sampled_token) for s in b.lens]
    assert [(s.position, s.layers, s.block_table, s.block_size) for s in a.attention] == \
        [(s.position, s.layers, s.block_table, s.block_size) for s in b.attention]
    np.testing.assert_array_equal(a.norms(), b.norms())


def test_export_round_trip_with_transformer_lens_names(watched, tmp_path):
    _, trace, _ = watched
    path = trace.export(tmp_path / "trace")
    back = RequestTrace.load(path)
    assert_traces_equal(trace, back)
    keys = trace.to_arrays()
    L = trace.num_layers
    for name in ["hook_embed.norm", "blocks.0.attn.hook_pattern.step0",
                 "blocks.0.attn.hook_pattern.prefill", "logit_lens.top_ids"] + \
            [f"blocks.{l}.hook_resid_post.norm" for l in range(L)]:
        assert name in keys, name
    np.testing.assert_array_equal(keys["blocks.1.hook_resid_post.norm"], trace.norms()[:, 2])


def test_export_round_trip_keeps_routing(moe, tmp_path):
    arch, engine, hf, out, trace, ref = moe
    back = RequestTrace.load(trace.export(tmp_path / f"{arch}.npz"))
    assert_traces_equal(trace, back)
    keys = trace.to_arrays()
    for layer in MOE[arch]:
        assert f"blocks.{layer}.mlp.hook_router_scores" in keys
    assert ("blocks.0.mlp.hook_shared_expert_gate" in keys) == (arch == "qwen2_moe")
    for a, b in zip(trace.routing(), back.routing()):
        np.testing.assert_array_equal(a, b)


# ---- off means off -----------------------------------------------------------------------------
def _forward_ops(llm, prompt_ids, watch=None, manager=True) -> dict[str, int]:
    """ATen op counts of one eager decode forward (run on this thread, under the engine lock).
    manager=False plans nothing at all: the bare model's forward."""
    from torch.profiler import ProfilerActivity, profile

    from engine.step_inputs import build_step_inputs
    from engine.scheduler import ScheduledSeq
    with llm.loop.lock:
        from engine.sequence import Sequence
        seq = Sequence.from_request(llm.process(prompt_ids, greedy(4), watch))
        if watch is not None:
            llm.probes.register(seq)
        llm.block_manager.allocate(seq)
        try:
            entry = [ScheduledSeq(seq, 1, len(seq) - 1)]
            plan = llm.probes.plan(entry) if manager else None
            inp = build_step_inputs(0, entry, BLOCK, None, plan)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                llm.runner.execute_step(inp)
        finally:
            llm.block_manager.free(seq)
    return {e.key: e.count for e in prof.key_averages()}


def test_probes_off_add_no_ops_to_the_forward(llm):
    """An unwatched step runs exactly the bare model's ops; a watched one runs more (so the
    comparison can fail)."""
    p = prompt(40, 12)
    off = _forward_ops(llm, p)
    assert off == _forward_ops(llm, p, manager=False)
    on = _forward_ops(llm, p, watch=ProbeSpec())
    assert sum(on.values()) > sum(off.values())
