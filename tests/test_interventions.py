"""Interventions without a model forward: validation, the per-step tables, the prefix-cache key,
the router kernel's bias, the CUDA-graph tables' refill (on the CPU), and the trace export."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from engine import Intervention
from engine.interventions.plan import InterventionPlanner
from engine.interventions.spec import ModelFacts, cache_salt, per_prompt, resolve_interventions

DENSE = ModelFacts(num_layers=4, num_heads=8, hidden_size=16, moe_layers=(), num_experts=0,
                   top_k=0)
MOE = ModelFacts(num_layers=4, num_heads=8, hidden_size=16, moe_layers=(1, 3), num_experts=6,
                 top_k=2)


# ---- validation ----------------------------------------------------------------------------------
@pytest.mark.parametrize("make,words", [
    (lambda: Intervention.ablate_heads(1.5, [0]), "layer must be an integer"),
    (lambda: Intervention.ablate_heads(0, []), "non-empty list"),
    (lambda: Intervention.ablate_heads(0, ["a"]), "non-empty list"),
    (lambda: Intervention.mask_experts(0, None), "non-empty list"),
    (lambda: Intervention.steer(0, [[1.0]]), "1-D"),
    (lambda: Intervention.steer(0, [1.0, float("nan")]), "NaN"),
    (lambda: Intervention.steer(0, [1.0], scale=float("inf")), "finite"),
    (lambda: Intervention.steer(0, [1.0], positions="last"), "positions must be one of"),
    (lambda: Intervention.steer(0, "abc"), "vector"),
])
def test_bad_arguments_fail_at_construction(make, words):
    with pytest.raises(ValueError, match=words):
        make()


@pytest.mark.parametrize("ivs,facts,words", [
    ([Intervention.ablate_heads(4, [0])], DENSE, r"layer 4 is out of range .* \[-4, 4\)"),
    ([Intervention.ablate_heads(-5, [0])], DENSE, "out of range"),
    ([Intervention.ablate_heads(0, [8])], DENSE, r"heads \[8\] are out of range"),
    ([Intervention.mask_experts(0, [1])], DENSE, "dense model"),
    ([Intervention.mask_experts(0, [1])], MOE, r"MoE layers are \[1, 3\]"),
    ([Intervention.mask_experts(1, [6])], MOE, r"experts \[6\] are out of range"),
    ([Intervention.mask_experts(1, [0, 1]), Intervention.mask_experts(1, [2, 3])], MOE,
     r"interventions\[1\].*leave 2.*fewer than the 2|leave 2"),
    ([Intervention.steer(0, np.ones(15))], DENSE, "15 entries.*hidden_size=16"),
    (Intervention.ablate_heads(0, [0]), DENSE, "must be a list"),
    (["ablate"], DENSE, r"interventions\[0\] must be an Intervention"),
    ([Intervention("zap", 0)], DENSE, r"unknown kind 'zap'"),
    ([Intervention._capture(0)], DENSE, r"unknown kind '_capture'"),
])
def test_resolve_refuses_what_does_not_fit_the_model(ivs, facts, words):
    if words.endswith("leave 2"):
        ivs = ivs + [Intervention.mask_experts(1, [4])]
        words = r"interventions\[2\].*leave 1, fewer than the 2"
    with pytest.raises(ValueError, match=words):
        resolve_interventions(ivs, facts)


def test_resolve_counts_negative_layers_from_the_end():
    got = resolve_interventions([Intervention.ablate_heads(-1, [3, 1, 3]),
                                 Intervention.mask_experts(-3, [0])], MOE)
    assert [(g.layer, g.heads or g.experts) for g in got] == [(3, (1, 3)), (1, (0,))]


def test_generate_takes_one_list_for_all_prompts_or_one_per_prompt():
    a = [Intervention.ablate_heads(0, [1])]
    assert per_prompt(None, 2) == [None, None]
    assert per_prompt(a, 3) == [a, a, a]
    assert per_prompt([a, None], 2) == [a, None]
    assert per_prompt([], 2) == [[], []]
    with pytest.raises(ValueError, match="2 prompts but 3 intervention lists"):
        per_prompt([a, a, None], 2)


def test_llm_refuses_bad_interventions_before_queueing(qwen3_dir):
    from engine import LLM, SamplingParams
    with LLM(qwen3_dir, device="cpu", num_kv_blocks=16, block_size=4) as llm:
        with pytest.raises(ValueError, match="out of range"):
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=1),
                         interventions=[Intervention.ablate_heads(3, [0])])
        with pytest.raises(ValueError, match="dense model"):
            next(llm.stream([1, 2], interventions=[Intervention.mask_experts(0, [0])]))
        with pytest.raises(ValueError, match="hidden_size=64"):
            llm.submit([1, 2], on_event=lambda e: None,
                       interventions=[Intervention.steer(0, [1.0] * 3)])
        assert not llm.inspect().running and not llm.inspect().waiting


# ---- the prefix-cache key ------------------------------------------------------------------------
def test_cache_salt_is_stable_and_tells_interventions_apart():
    v = np.arange(16, dtype=np.float32)
    a = resolve_interventions([Intervention.steer(1, v, 2.0)], DENSE)
    assert cache_salt(()) is None
    assert cache_salt(a) == cache_salt(resolve_interventions([Intervention.steer(1, v.copy(), 2.0)], DENSE))
    others = [[Intervention.steer(1, v, 2.5)], [Intervention.steer(2, v, 2.0)],
              [Intervention.steer(1, v + 1e-3, 2.0)], [Intervention.steer(1, v, 2.0, "prompt")],
              [Intervention.ablate_heads(1, [0])], [Intervention.ablate_heads(1, [0, 1])]]
    salts = {cache_salt(resolve_interventions(o, DENSE)) for o in others}
    assert len(salts) == len(others) and cache_salt(a) not in salts


def test_block_manager_keeps_salted_chains_apart():
    from engine.block_manager import BlockManager
    from engine.sampling import SamplingParams
    from engine.sequence import Sequence
    bm = BlockManager(16, 4)
    ids = list(range(13))

    def seq(rid, salt):
        s = Sequence(rid, ids, SamplingParams(), 0)
        s.cache_salt = salt
        return s
    a = seq("a", None)
    bm.allocate(a)
    a.num_computed_tokens = len(ids)
    bm.commit(a)
    held = [a]
    # b: another salt than a's root, no hit; c: plain like a, hits; d: b's salt, hits b's chain;
    # e: a third salt, no hit
    for rid, salt, hits in (("b", 12345, 0), ("c", None, 3), ("d", 12345, 3), ("e", 999, 0)):
        s = seq(rid, salt)
        bm.allocate(s)
        assert s.num_cached_tokens == hits * 4, rid
        s.num_computed_tokens = len(ids)
        bm.commit(s)
        held.append(s)
    bm.check_invariants(held)


# ---- the per-step tables -------------------------------------------------------------------------
class _Seq:
    def __init__(self, ivs, P, facts=DENSE):
        self.interventions = resolve_interventions(ivs, facts)
        self.cache_salt = cache_salt(self.interventions)
        self.num_prompt_tokens = P
        self.is_finished = False


class _Sched:
    def __init__(self, seq, start, n):
        self.seq, self.start, self.num_tokens = seq, start, n


def test_plan_points_each_token_at_its_row_and_row0_is_the_identity():
    v = np.ones(16, np.float32)
    plain = _Seq([], 3)
    gen_only = _Seq([Intervention.steer(2, v, 2.0, "generated"), Intervention.ablate_heads(1, [5])], 4)
    same = _Seq([Intervention.steer(2, v, 2.0, "generated"), Intervention.ablate_heads(1, [5])], 9)
    planner = InterventionPlanner(DENSE)
    for s in (plain, gen_only, same):
        planner.add(s)
    assert planner.active
    # plain: prefill 3; gen_only: chunk over its prompt's end (positions 2..5, P=4); same: decode
    plan = planner.plan([_Sched(plain, 0, 3), _Sched(gen_only, 2, 4), _Sched(same, 9, 1)])
    assert plan.key == ((1,), (), (2,), ())
    sel = plan.sel.tolist()
    assert sel[:3] == [0, 0, 0]
    prompt_row, gen_row = sel[3], sel[5]
    assert sel[3:7] == [prompt_row, prompt_row, gen_row, gen_row] and prompt_row != gen_row
    assert sel[7] == gen_row, "identical interventions share a row"
    np.testing.assert_array_equal(plan.head_keep[0], 1.0)
    assert plan.head_keep[prompt_row, 0, 5] == 0 and plan.head_keep[prompt_row, 0].sum() == 7
    assert not plan.steer_on[0].any() and not plan.steer_on[prompt_row].any()
    assert plan.steer_on[gen_row].all()
    np.testing.assert_array_equal(plan.steer_add[gen_row, 0], 2.0)
    np.testing.assert_array_equal(plan.steer_add[0], 0.0)
    for s in (plain, gen_only, same):
        s.is_finished = True
    assert not planner.active and planner.plan([_Sched(plain, 0, 3)]) is None


def test_buffers_edit_only_the_selected_rows_bit_for_bit():
    from engine.interventions.buffers import InterventionBuffers
    facts = MOE
    ivs = [Intervention.ablate_heads(0, [1, 2]), Intervention.mask_experts(1, [4]),
           Intervention.steer(0, np.full(16, 0.25, np.float32), 4.0)]
    s = _Seq(ivs, 2, facts)
    planner = InterventionPlanner(facts)
    planner.add(s)
    plain = _Seq([], 2, facts)
    plan = planner.plan([_Sched(plain, 0, 2), _Sched(s, 0, 2)])
    # TP rank 1 of 2: heads 4..7 of 8
    bufs = InterventionBuffers(plan, torch.device("cpu"), torch.float32, slice(4, 8))
    o = torch.randn(4, 4, 3)
    np.testing.assert_array_equal(bufs.ablate(0, o).numpy(), o.numpy())   # heads 1, 2 on rank 0
    bufs0 = InterventionBuffers(plan, torch.device("cpu"), torch.float32, slice(0, 4))
    out = bufs0.ablate(0, o)
    assert torch.equal(out[:2], o[:2]) and torch.equal(out[2:, [0, 3]], o[2:, [0, 3]])
    assert (out[2:, 1:3] == 0).all()
    assert bufs0.ablate(1, o) is o
    bias = bufs0.router_bias(1)
    assert (bias[:2] == 0).all() and torch.isinf(bias[2:, 4]).all() and bufs0.router_bias(3) is None
    h, r = torch.randn(4, 16), torch.randn(4, 16)
    got = bufs0.layer_out(0, h, r)
    assert torch.equal(got[:2], h[:2]) and torch.equal(got[2:], h[2:] + 1.0)


def test_graph_tables_refill_per_step_and_pad_with_the_identity():
    from engine.interventions.buffers import GraphInterventionBuffers
    ivs = [Intervention.ablate_heads(2, [0]), Intervention.steer(1, np.ones(16), 1.0)]
    planner = InterventionPlanner(DENSE)
    a, b = _Seq(ivs, 1), _Seq([], 1)
    planner.add(a)
    plan = planner.plan([_Sched(b, 5, 1), _Sched(a, 7, 1)])
    g = GraphInterventionBuffers(plan.key, 8, DENSE, torch.device("cpu"), torch.float32,
                                 slice(0, 8))
    view = g.view(4)                     # the bucket-4 graph's buffers: the same storage
    g.load_plan(plan)
    assert view.sel.tolist() == [0, 1, 0, 0]
    o = torch.randn(4, 8, 2)
    out = view.ablate(2, o)
    assert torch.equal(out[[0, 2, 3]], o[[0, 2, 3]]) and (out[1, 0] == 0).all()
    h = torch.zeros(4, 16)
    assert view.layer_out(1, h, h)[:, 0].tolist() == [0, 1, 0, 0]
    plan2 = planner.plan([_Sched(a, 8, 1), _Sched(b, 6, 1)])     # next step: rows swapped
    g.load_plan(plan2)
    assert view.sel.tolist() == [1, 0, 0, 0]
    assert view.layer_out(1, h, h)[:, 0].tolist() == [1, 0, 0, 0]


# ---- the router kernel's bias (Triton, interpreted on the CPU) -----------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_route_hidden_bias_equals_masking_the_logits(dtype):
    import torch.nn.functional as F

    from engine.kernels.moe_routing import route_counts, route_hidden, route_ref
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(2), "little"))
    n, E, k, H = 5, 16, 4, 40
    x = torch.randn(n, H, generator=g).to(dtype)
    w = (torch.randn(E, H, generator=g) / H ** 0.5).to(dtype)
    bias = torch.zeros(n, E)
    bias[1, [0, 3, 7]] = float("-inf")
    bias[4, :10] = float("-inf")
    probs, tw, ids = route_hidden(x, w, k, True, route_counts("cpu"), bias=bias)
    logits = F.linear(x.float(), w.float()).to(dtype).float() + bias
    rp, rw, rids = route_ref(logits, k, True)
    torch.testing.assert_close(probs, rp, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(tw, rw, rtol=1e-5, atol=1e-6)
    assert not np.isin(ids[1], [0, 3, 7]).any() and (ids[4] >= 10).all()
    plain = route_hidden(x, w, k, True, route_counts("cpu"))
    for r in (0, 2, 3):                   # rows with an all-zero bias: bit for bit unchanged
        assert torch.equal(probs[r], plain[0][r]) and torch.equal(ids[r], plain[2][r])


# ---- the trace says what was done ----------------------------------------------------------------
def test_trace_export_records_the_interventions(qwen3_dir, tmp_path):
    from engine import LLM, ProbeSpec, RequestTrace, SamplingParams
    v = np.linspace(-1, 1, 64).astype(np.float32)
    ivs = [Intervention.ablate_heads(-1, [2]), Intervention.steer(0, v, 2.0, "prompt")]
    with LLM(qwen3_dir, device="cpu", num_kv_blocks=32, block_size=4) as llm:
        out = llm.generate([[3, 4, 5]], SamplingParams(max_tokens=2),
                           watch=ProbeSpec(attention=False), interventions=ivs)
        tr = llm.trace(out[0].request_id)
    path = tr.export(tmp_path / "t")
    back = RequestTrace.load(path)
    assert back.interventions[0] == {"kind": "ablate_heads", "layer": 2, "heads": [2]}
    st = back.interventions[1]
    assert (st["kind"], st["layer"], st["scale"], st["positions"]) == ("steer", 0, 2.0, "prompt")
    np.testing.assert_array_equal(np.array(st["vector"], np.float32), v)
    import json
    meta = json.loads(path.with_suffix(".json").read_text())
    assert "vector" not in meta["interventions"][1]          # vectors live in the .npz


def test_a_step_with_nothing_to_edit_has_no_plan():
    """Prompt-only steering in a decode step, or a steering-vector request's decode: no tables,
    so the step runs exactly the plain path (plain graphs included)."""
    planner = InterventionPlanner(DENSE)
    s = _Seq([Intervention.steer(1, np.ones(16), 2.0, "prompt")], 4)
    planner.add(s)
    assert planner.plan([_Sched(s, 0, 4)]) is not None            # the prompt: steered
    assert planner.plan([_Sched(s, 6, 1)]) is None                # a decode step: nothing


# ---- the benchmark runs (figures only mean something on a GPU) ----------------------------------
@pytest.mark.parametrize("model", ["qwen3-0.6b", "qwen3-30b-a3b"])
def test_interventions_bench_runs_tiny_on_cpu(model):
    import math

    from bench.diagnostics import interventions
    rows = interventions.main(model, "cpu", num_requests=2, tput_repeats=1, lat_repeats=1,
                              tiny=True, floors=False)
    assert not [r for r in rows if r.get("error") or "error" in str(r.get("metric", ""))], rows
    got = {r["metric"]: r["value"] for r in rows}
    kinds = ["ablate_heads", "steer"] + (["mask_experts"] if "30b" in model else [])
    for k in ["none"] + kinds:
        assert got[f"ms_per_token[{k}]"] > 0 and got[f"output_tok_s[{k}]"] > 0
    for k in kinds:
        assert math.isfinite(got[f"decode_slowdown_pct[{k}]"])
