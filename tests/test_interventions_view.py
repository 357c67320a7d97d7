"""The chat tab's "What if" accordion: the form becomes interventions, and the comparison says
where the two replies part and how the chosen tokens' logprobs moved."""
from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.sequence import RequestOutput, TokenLogprobs
from views.interventions import compare, make_interventions, parse_ids


def _out(tokens, lps, tops, text):
    return RequestOutput("r", None, [1], tokens, text, "length",
                         [TokenLogprobs(t, lp, top) for t, lp, top in zip(tokens, lps, tops)])


def test_compare_names_the_first_differing_token_and_the_logprob_change():
    orig = _out([5, 6, 7], [-0.1, -0.2, -0.3], [{5: -0.1}, {6: -0.2}, {7: -0.3}], "a b c")
    edited = _out([5, 9, 7], [-0.4, -0.5, -0.6], [{5: -0.4}, {9: -0.5, 6: -1.5}, {7: -0.6}],
                  "a x c")
    md = compare(orig, edited, lambda ids: f"t{ids[0]}", "ablate heads [0] at layer 1")
    assert "They part at token 1" in md and "'t6'" in md and "'t9'" in md
    assert "| 0 | 't5' | -0.100 | 't5' | -0.400 | -0.300 |" in md
    assert "| 1 | 't6' | -0.200 | 't9' | -0.500 | -1.300 |" in md
    assert "| 2 |" not in md                    # rows stop at the parting token
    first = compare(orig, _out([8, 6, 7], [-0.9] * 3, [{8: -0.9, 5: -2.0}, {}, {}], "y b c"),
                    lambda ids: f"t{ids[0]}", "x")
    assert "They part at token 0" in first and "| 0 | 't5' | -0.100 | 't8' | -0.900 | -1.900 |" \
        in first and "| 1 |" not in first
    same = compare(orig, orig, lambda ids: "", "x")
    assert "Same tokens from start to end." in same


def test_form_values_become_interventions(qwen3_dir):
    assert parse_ids("0, 3 5", "heads") == [0, 3, 5]
    with pytest.raises(ValueError, match="integers"):
        parse_ids("zero", "heads")
    with LLM(qwen3_dir, device="cpu", num_kv_blocks=32, block_size=4) as llm:
        (iv,) = make_interventions(llm, "ablate heads", 1, "0, 3", "", "", 1.0, "all")
        assert (iv.kind, iv.layer, iv.heads) == ("ablate_heads", 1, (0, 3))
        (iv,) = make_interventions(llm, "steer", -1, "", "hello world", "one two three", 3.0,
                                   "generated")
        assert iv.vector.shape == (64,) and iv.scale == 3.0 and iv.positions == "generated"
        with pytest.raises(ValueError, match="two contrasting prompts"):
            make_interventions(llm, "steer", 0, "", "hello", "", 1.0, "all")
        orig, edited = llm.generate([[1, 2, 3]] * 2, SamplingParams(temperature=0, max_tokens=6,
                                                                  logprobs=5),
                                    interventions=[None, [iv]])
        md = compare(orig, edited, llm.tokenizer.decode, iv.describe())
        assert "steer layer -1 by 3" in md and "They part" in md


def test_overlay_figure_shows_both_runs_norms_and_lens_at_the_parting_token(qwen3_dir):
    from engine import Intervention, ProbeSpec
    from views.figures_interventions import overlay_figure
    from views.interventions import parting
    with LLM(qwen3_dir, device="cpu", num_kv_blocks=32, block_size=4) as llm:
        watch = ProbeSpec(attention=False, routing=False)
        a, b = llm.generate([[1, 2, 3]] * 2, SamplingParams(temperature=0, max_tokens=5),
                            watch=watch,
                            interventions=[None, [Intervention.ablate_heads(0, [0, 1, 2])]])
        ta, tb = llm.trace(a.request_id), llm.trace(b.request_id)
    step = parting(a, b)
    assert step is not None
    fig = overlay_figure(ta, tb, step, llm.tokenizer.decode)
    norms = [t for t in fig["data"] if t["yaxis"] == "y"]
    lens = [t for t in fig["data"] if t["yaxis"] == "y2"]
    assert len(norms) == 2 and len(lens) == 2
    row = 3 - 1 + step
    assert norms[0]["y"] == ta.norms()[row].tolist() and norms[1]["y"] == tb.norms()[row].tolist()
    assert norms[0]["y"][0] == norms[1]["y"][0], "the embedding is before any edit"
    assert lens[0]["y"] == ta.lens[step].sampled_prob.tolist()


def test_a_click_on_the_routing_chart_picks_layer_and_expert():
    from views.interventions import expert_pick
    assert expert_pick({"row": 1, "col": 5, "x": 5, "y": "L3"}) == (3, 5)
    assert expert_pick({"x": 2.0, "y": "L0"}) == (0, 2)
    assert expert_pick({"x": 2, "y": "moe0"}) is None
    assert expert_pick({}) is None and expert_pick({"x": "a", "y": "L1"}) is None


def test_the_form_offers_expert_masking_only_on_moe_and_names_experts_and_top_k():
    from types import SimpleNamespace

    from views.interventions import form_help, kinds_for
    assert "mask experts" not in kinds_for(False) and "mask experts" in kinds_for(True)
    cfg = SimpleNamespace(num_hidden_layers=4, num_attention_heads=4, num_experts=8,
                          num_experts_per_tok=2)
    moe = SimpleNamespace(hf_config=cfg, runner=SimpleNamespace(moe_layers=[1, 3]))
    text = form_help(moe)
    assert "8 experts" in text and "top-2" in text and "layers [1, 3]" in text
    dense = SimpleNamespace(hf_config=cfg, runner=SimpleNamespace(moe_layers=[]))
    assert "expert" not in form_help(dense)


def test_the_overlay_has_the_charts_look_and_keeps_equal_runs_apart():
    """Issue 52.9: built like every other chart (fonts, white ground, no plotly legend box) and
    two runs that agree still show as two lines (different width and dash)."""
    from types import SimpleNamespace

    import numpy as np

    from views.figures_interventions import overlay_figure
    lens = SimpleNamespace(top_ids=np.zeros((2, 5), int), sampled_token=1,
                           sampled_prob=np.array([0.99, 1.0]))
    tr = SimpleNamespace(prompt_token_ids=[1, 2], num_layers=2, lens=[lens],
                         norms=lambda: np.ones((3, 3)))
    fig = overlay_figure(tr, tr, 0, lambda ids: "x")
    lay = fig["layout"]
    assert lay["plot_bgcolor"] == "white" and lay["showlegend"] is False
    assert "untouched" in lay["title"]["text"] and "intervened" in lay["title"]["text"]
    a, b = [t for t in fig["data"] if t["yaxis"] == "y2"]
    assert a["y"] == b["y"] and a["line"]["width"] > b["line"]["width"]
    assert b["line"].get("dash") == "dash"
