"""Anatomy figure and HTML builders on records made without an engine: a tiny model built on
the meta device, a random cache tensor, synthetic traces drawn from a fresh seed each run
(printed; GLASSBOX_TEST_SEED=n replays one). Figures are plotly JSON dicts ({"data": [trace
dicts], "layout": {...}}); shapes, labels, numbers, states."""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from ui_helpers import make_trace  # noqa: I001  (puts the repo on sys.path)
from figure_helpers import check_plotly_figure, decode, seeded_rng, strict_json

from engine.anatomy import (ModelAnatomy, architecture_of_config, published_rows, shape_row,
                            tokenize)
from engine.anatomy.kv_regions import kv_data_plane
from engine.anatomy.runtime_code import runtime_code
from engine.anatomy.tensor_parallel import collective_points
from engine.anatomy.token_path import token_path
from engine.anatomy.vocabulary import vocabulary
from engine.anatomy.weights import weight_breakdown
from engine.models.registry import model_class
from engine.parallel_state import TPGroup, use_tp
from engine.records import BlockInfo
from tiny_models import build_tokenizer, make_config
from views import figures_anatomy as FA
from views import figures_anatomy_html as FH
from views import figures_anatomy_path as FP
from views.live_plot import plot_value


@pytest.fixture
def rng(request):
    return seeded_rng(request)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tokenizer(str(tmp_path_factory.mktemp("tok")))


def make_anatomy(arch: str, tokenizer=None, num_blocks: int = 6, block_size: int = 4,
                 tp: int = 1, device: str = "cpu", **kw) -> ModelAnatomy:
    cfg = make_config(arch, **kw)
    with torch.device("meta"), use_tp(TPGroup(0, tp)):
        model = model_class(cfg)(cfg, 32)
    a = architecture_of_config(cfg, f"tiny-{arch}")
    d = a.head_dim
    cache = torch.randn(2, a.num_layers, num_blocks, block_size, max(a.num_kv_heads // tp, 1), d)
    return ModelAnatomy(
        model_name=a.name, dtype="float32", device=device, tp_size=tp, block_size=block_size,
        num_kv_blocks=num_blocks, arch=a,
        vocabulary=vocabulary(tokenizer, a.vocab_size, [2]),
        weights=weight_breakdown(a, 4, "float32"), code=runtime_code(model), path=token_path(a),
        kv=kv_data_plane(cache), collectives=collective_points(model),
        rank0_params=sum(p.numel() for p in model.parameters()))


# ---- plots -----------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["qwen3", "qwen2_moe"])
def test_weights_figure_stacks_every_part_to_the_total(arch):
    a = make_anatomy(arch)
    fig = FA.weights_figure(a.weights)
    data = fig["data"]
    rows = data[0]["y"]
    assert len(data) == sum(1 for p in a.weights.parts if p.params)
    assert all(t["type"] == "bar" and t["orientation"] == "h" for t in data)
    assert sum(t["x"][0] for t in data) == a.weights.total_bytes
    if a.arch.is_moe:
        assert list(rows) == ["all weights", "read per token"]
        assert sum(t["x"][1] for t in data) == a.weights.active_params * 4
    else:
        assert list(rows) == ["all weights"]
    assert f"{FA.fmt_bytes(a.weights.total_bytes)}" in fig["layout"]["title"]["text"]
    assert {t["name"] for t in data} == {p.group for p in a.weights.parts if p.params}
    assert sum(t["showlegend"] for t in data) == len({t["name"] for t in data})
    assert fig["layout"]["barmode"] == "stack" and fig["layout"]["showlegend"] is True


def test_kv_regions_figure_marks_each_region_at_its_offset(rng):
    a = make_anatomy("qwen3", num_blocks=6)
    block = int(rng.integers(6))
    fig = FA.kv_regions_figure(a.kv, block)
    bars = [t for t in fig["data"] if t["type"] == "bar"]
    regions = a.kv.regions(block)
    assert [b["base"][0] for b in bars] == [r.offset for r in regions]
    grid = next(t for t in fig["data"] if t["type"] == "heatmap")
    assert [int(x.replace(",", "")) for row in grid["text"] for x in row] == \
        [r.offset for r in regions]
    assert list(fig["layout"]["xaxis"]["range"]) == [0, a.kv.total_bytes]
    assert len(fig["layout"]["shapes"]) == 2 * a.arch.num_layers   # one slab per K/V layer
    assert f"Block {block}:" in fig["layout"]["title"]["text"]
    bad = FA.kv_regions_figure(a.kv, 6)
    assert "block_id must be in [0, 6)" in bad["layout"]["annotations"][0]["text"]


def test_tp_bytes_figure_shows_each_degree_and_why_one_is_impossible():
    a = make_anatomy("qwen3")                        # 4 heads: TP 8 cannot split them
    plans = [a.tp_plan(t) for t in (1, 2, 4, 8)]
    fig = FA.tp_bytes_figure(plans, running_tp=1)
    weights, kv, budget = fig["data"]
    assert list(weights["x"]) == ["TP 1 (running)", "TP 2", "TP 4", "TP 8"]
    assert list(weights["y"]) == [p.weight_bytes_per_rank for p in plans[:3]] + [0]
    assert kv["y"][1] == plans[1].ranks[0].layout.kv_cache_bytes
    assert set(budget["y"]) == {plans[0].budget_bytes}
    note = fig["layout"]["annotations"][0]
    assert note["x"] == "TP 8" and "num_attention_heads=4" in note["text"]
    assert fig["layout"]["yaxis"]["type"] == "log"
    lo, hi = fig["layout"]["yaxis"]["range"]          # log10: every bar and the budget fit
    tops = [w + k for w, k in zip(weights["y"], kv["y"])] + [plans[0].budget_bytes]
    assert 10 ** lo <= min(v for v in weights["y"] + kv["y"] if v > 0) and 10 ** hi >= max(tops)


def test_depth_width_figure_puts_the_loaded_model_beside_published_ones():
    a = make_anatomy("qwen3_moe")
    rows = published_rows() + [shape_row(a.model_name, a.arch, loaded=True)]
    fig = FA.depth_width_figure(rows)
    by = {t["name"]: t for t in fig["data"]}
    assert set(by) == {"published dense", "published MoE", "loaded model (live)"}
    assert "Qwen3-235B-A22B" in by["published MoE"]["text"]
    assert list(by["loaded model (live)"]["x"]) == [a.arch.num_layers]
    assert list(by["loaded model (live)"]["y"]) == [a.arch.hidden_size]
    assert by["loaded model (live)"]["marker"]["symbol"] == "star"
    assert fig["layout"]["xaxis"]["type"] == fig["layout"]["yaxis"]["type"] == "log"


def test_live_token_reads_norms_lens_and_routing_of_one_position(rng):
    num_prompt, num_out = int(rng.integers(3, 10)), int(rng.integers(3, 10))
    tr = make_trace(rng, num_prompt=num_prompt, num_out=num_out, num_layers=3, moe_experts=8)
    t = int(rng.integers(num_prompt, num_prompt + num_out - 1))   # a reply token with a lens
    live = FA.live_token(tr, t, decode)
    np.testing.assert_array_equal(live.norms, tr.resid_norms[t])
    step = next(s for s in tr.lens if s.position == t)
    assert live.lens[-1] == (decode([int(step.top_ids[-1, 0])]), float(step.top_probs[-1, 0]))
    assert live.sampled == decode([step.sampled_token])
    assert [r[1] for r in live.routed] == [list(map(int, x)) for x in tr.router_topk_ids[t]]
    assert live.text == f"tok{t}" and live.token_id == tr.output_token_ids[t - num_prompt]
    assert FA.live_token(tr, int(rng.integers(num_prompt - 1)), decode).lens is None  # prompt
    assert FA.live_token(tr, num_prompt + num_out, decode) is None


def test_every_anatomy_figure_sets_uirevision_text_titles_and_strict_json():
    a = make_anatomy("qwen3_moe")
    rows = published_rows() + [shape_row(a.model_name, a.arch, loaded=True)]
    figs = [FA.weights_figure(a.weights), FA.kv_regions_figure(a.kv, 2),
            FA.kv_regions_figure(a.kv, 99), FA.tp_bytes_figure([a.tp_plan(t) for t in (1, 2)], 1),
            FA.tp_bytes_figure([], 1), FA.depth_width_figure(rows), FA.depth_width_figure([])]
    for fig in figs:
        check_plotly_figure(fig)
        assert strict_json(plot_value(fig))["layout"]["uirevision"] == fig["layout"]["uirevision"]
    assert len({f["layout"]["uirevision"] for f in figs if f["data"]}) == 4   # one per plot


def test_token_path_of_a_prefix_cached_token_shows_no_made_up_numbers(rng):
    a = make_anatomy("qwen3_moe")
    tr = make_trace(rng, num_layers=a.arch.num_layers, moe_experts=8,
                    num_prompt=int(rng.integers(4, 10)))
    k = int(rng.integers(1, len(tr.prompt_token_ids)))
    for i in range(k):             # ProbeManager's _put: NaN rows, -1 expert ids
        tr.resid_norms[i] = np.full_like(tr.resid_norms[i], np.nan)
        tr.router_probs[i] = np.full_like(tr.router_probs[i], np.nan)
        tr.router_topk_ids[i] = np.full_like(tr.router_topk_ids[i], -1)
        tr.router_topk_weights[i] = np.full_like(tr.router_topk_weights[i], np.nan)
    live = FA.live_token(tr, int(rng.integers(k)), decode)
    for out in (FP.token_path_html(a, live), FP.layer_html(a, live)):
        assert "nan" not in out and "-1" not in out


# ---- HTML ------------------------------------------------------------------------------------

def test_tokens_html_has_one_chip_per_token_with_its_id(tokenizer):
    pieces = tokenize(tokenizer, "hello world<|im_end|>")
    out = FH.tokens_html(pieces)
    assert re.findall(r'class="anat-tok" data-id="(\d+)"', out) == [str(p.id) for p in pieces]
    assert pieces[-1].special and "#212529" in out.split('data-id="%d"' % pieces[-1].id)[1][:200]
    assert "no tokens" in FH.tokens_html([])


def test_vocabulary_html_shows_sizes_specials_and_the_wrapped_conversation(tokenizer):
    a = make_anatomy("qwen3", tokenizer)
    out = FH.vocabulary_html(a.vocabulary)
    assert f"<b>{a.arch.vocab_size:,}</b> embedding rows" in out
    assert f"produces <b>{len(tokenizer):,}</b> ids" in out
    assert out.count("&lt;|im_start|&gt;") >= 4          # the specials, then 3 in the chat
    assert "rows no text reaches" in out                  # 512 rows, fewer tokenizer ids


def test_weights_table_lists_every_part_and_the_total():
    a = make_anatomy("qwen2_moe", tie_word_embeddings=True)
    out = FH.weights_table_html(a.weights)
    assert out.count("<tr>") == len(a.weights.parts) + 2        # header + parts + total
    assert "tied to embed_tokens" in out and "shared_expert_gate" in out
    assert f"<b>{a.weights.total_params:,}</b>" in out


@pytest.mark.parametrize("device,here,other", [("cpu", "rms_norm_ref", "rms_norm "),
                                               ("cuda", "rms_norm ", "rms_norm_ref")])
def test_code_table_puts_this_devices_kernels_in_the_runs_here_column(device, here, other):
    a = make_anatomy("qwen3", device=device)
    out = FH.code_table_html(a.code, device)
    row = out.split("<b>input_norm</b>")[1].split("</tr>")[0]
    cells = [c.replace("<wbr>", "") for c in re.findall(r"<td[^>]*>(.*?)</td>", row, flags=re.S)]
    assert here in cells[1] and other in cells[2]
    # long names wrap between their parts: a break opportunity after each separator only
    assert "rms_<wbr>norm_<wbr>ref" in out and "kernels/<wbr>rmsnorm.<wbr>py" in out
    assert f"runs here ({'GPU' if device == 'cuda' else 'CPU'})" in out
    assert out.count("then all_reduce") == 3             # embedding, o_proj, down_proj


def test_token_path_diagram_has_every_stage_and_live_numbers(rng):
    a = make_anatomy("qwen3_moe")
    tr = make_trace(rng, num_layers=a.arch.num_layers, moe_experts=8)
    live = FA.live_token(tr, 7, decode)
    out = FP.token_path_html(a, live)
    assert re.findall(r'data-stage="(\w+)"', out) == [s.key for s in a.path.outer]
    assert len(re.findall(r'class="anat-layer" data-layer', out)) == a.arch.num_layers
    assert f"‖x‖ = {live.norms[0]:.4g}" in out
    for layer, experts, _ in live.routed:
        assert f"L{layer} moe ‖r‖ {live.norms[layer + 1]:.3g}" in out
        assert "experts " + ",".join(map(str, experts)) in out
    assert "[64 hidden]" in out and "[512 vocab]" in out
    assert "‖x‖" not in FP.token_path_html(a)            # nothing live without a token


@pytest.mark.parametrize("arch", ["qwen3", "qwen2_moe"])
def test_layer_diagram_shows_attention_gqa_and_the_mlp_kinds(arch):
    a = make_anatomy(arch)
    out = FP.layer_html(a)
    assert len(re.findall(r'class="anat-gqa" data-kv', out)) == a.arch.num_kv_heads
    assert ("dense MLP" in out) == bool(a.path.mlp)
    assert ("MoE block" in out) == a.arch.is_moe
    if arch == "qwen2_moe":
        assert "dense MLP (layers 1)" in out and "shared expert" in out


def test_kv_plane_and_block_info():
    a = make_anatomy("qwen3", num_blocks=6, block_size=4)
    out = FH.kv_plane_html(a.kv, tp=1)
    strides = re.findall(r"<td[^>]*>([\d,]+)</td><td[^>]*>([\d,]+)</td></tr>", out)
    assert [int(s.replace(",", "")) for s, _ in strides] == list(a.kv.strides)
    assert [int(b.replace(",", "")) for _, b in strides] == list(a.kv.byte_strides)
    block = BlockInfo(3, 2, ["req-0", "req-1"], 3, None, False, [5, 6, 2])
    info = FH.block_info_html(block, 4, decode, [0.5, -1.0], 128, frozenset({2}))
    assert "req-0, req-1" in info and "3/4 slots" in info and "ref count 2" in info
    assert re.findall(r'data-id="(\d+)"', info) == ["5", "6", "2"]
    assert "[0.5, -1]" in info and "offset 128" in info
    assert "no such block" in FH.block_info_html(None, 4, decode)


def test_tp_table_notes_replicated_kv_heads_and_the_collectives():
    a = make_anatomy("qwen3", num_attention_heads=8, num_key_value_heads=2)
    plan = a.tp_plan(4)
    out = FH.tp_table_html(plan, a).replace("<wbr>", "")
    assert out.count("<tr>") == 1 + 4
    assert "KV heads replicated" in out and "2 ranks hold a copy" in out
    assert f"({plan.collectives_per_forward} at TP 4)" in out
    assert "layers.{L}.self_attn.o_proj" in out
    assert "not possible" in FH.tp_table_html(a.tp_plan(16), a)


def test_shapes_table_has_the_published_rows_and_the_loaded_one():
    a = make_anatomy("qwen3")
    rows = published_rows() + [shape_row(a.model_name, a.arch, loaded=True)]
    out = FH.shapes_table_html(rows, "source line")
    assert out.count("<tr>") == len(rows) + 1
    assert "(card 30.5B, 3.3B active)" in out and "(loaded, live)" in out
    assert "128 × 768, top-8" in out and "source line" in out


def test_byte_axes_tick_in_binary_units_not_plotlys_si_billions():
    """Issue 52.8: the axes read KiB / MiB / GiB like the figures beside them, never "10B"."""
    a = make_anatomy("qwen3")
    for fig, axis in ((FA.tp_bytes_figure([a.tp_plan(t) for t in (1, 2)], 1), "yaxis"),
                      (FA.weights_figure(a.weights), "xaxis")):
        ticks = fig["layout"][axis]["ticktext"]
        assert ticks and all(t.endswith(("B", "KiB", "MiB", "GiB", "TiB")) for t in ticks), ticks
        assert not any(t[-2:-1].isdigit() and t.endswith("B") and " " not in t for t in ticks)
