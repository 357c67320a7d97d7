"""Figure builders on synthetic snapshots and traces: shapes, labels, colours, fixed ranges."""
import re

import numpy as np
import pytest

from ui_helpers import make_snapshot, make_trace  # noqa: I001  (puts the repo on sys.path)

from views import figures as F
from views import figures_kv, figures_layers
from views.figures_common import EVICTABLE_COLOUR, FREE_COLOUR


def decode(ids):
    return " ".join(f"t{i}" for i in ids)


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


# ---- KV cache -------------------------------------------------------------------------------

def test_kv_grid_has_one_cell_per_block_with_state_classes(rng):
    snap = make_snapshot(rng)
    html = F.kv_grid_html(snap, decode)
    grid = html.split('class="kv-grid"', 1)[1]
    cells = re.findall(r'class="kv-cell kv-(\w+)" data-block="(\d+)"', grid)
    assert [int(b) for _, b in cells] == list(range(snap.num_blocks))
    states = {int(b): s for s, b in cells}
    assert states[0] == states[1] == "shared"
    assert states[2] == states[3] == "owned"
    assert states[4] == "evictable"
    assert all(states[i] == "free" for i in range(5, snap.num_blocks))


def test_kv_grid_colours_owner_shade_fill_and_evictable_grey(rng):
    snap = make_snapshot(rng)
    html = F.kv_grid_html(snap, decode)
    cell = {int(m.group(1)): m.group(0) for m in
            re.finditer(r'<div class="kv-cell[^"]*" data-block="(\d+)"[^>]*>', html)}
    c0 = F.request_colour("req-0")
    assert f"{c0} 100%" in cell[0]                 # full block: colour fills 100%
    assert f"{c0} 75%" in cell[2]                  # 3 of 4 slots written
    assert f"{F.request_colour('req-1')} 25%" in cell[3]
    assert EVICTABLE_COLOUR in cell[4]
    assert EVICTABLE_COLOUR not in cell[5] and FREE_COLOUR in cell[5]
    assert F.request_colour("req-0") != F.request_colour("req-1")


def test_kv_grid_tooltip_shows_id_refcount_owners_and_decoded_text(rng):
    snap = make_snapshot(rng)
    html = F.kv_grid_html(snap, decode)
    tip = re.search(r'data-block="1"[^>]*data-tip="([^"]*)"', html).group(1)
    text = decode(snap.blocks[1].token_ids)
    assert "block 1" in tip and "ref 2" in tip and "req-0, req-1" in tip and text in tip


def test_kv_grid_caps_huge_caches_but_keeps_used_blocks(rng):
    snap = make_snapshot(rng, num_blocks=10_000)
    html = F.kv_grid_html(snap, decode)
    assert html.count('class="kv-cell kv-') - 4 == figures_kv.MAX_GRID_CELLS  # 4 in legend
    assert 'data-block="4"' in html and "showing 4096 of 10000" in html


def test_block_tables_list_physical_ids_and_mark_shared(rng):
    snap = make_snapshot(rng)
    html = F.block_tables_html(snap)
    rows = re.findall(r'data-request="([^"]+)"', html)
    assert rows == ["req-0", "req-1"]
    row0 = html.split('data-request="req-0"')[1].split('data-request="req-1"')[0]
    assert re.findall(r'>(\d+)</span>', row0) == ["0", "1", "2"]
    assert row0.count("kv-tshared") == 2


def test_kv_usage_figure_has_fixed_axes_and_uirevision(rng):
    snap = make_snapshot(rng)
    now = snap.steps[-1].wall_time + 1
    fig = F.kv_usage_figure(snap, [(now - 5, 0.25), (now - 1, 0.5)], now)
    usage, hits = fig.data
    assert len(usage.x) == len(snap.steps) and list(usage.y) == [s.kv_usage for s in snap.steps]
    assert list(hits.y) == [0.25, 0.5]
    assert tuple(fig.layout.yaxis.range) == (0, 1.02) and tuple(fig.layout.xaxis.range) == (-60, 0)
    assert fig.layout.uirevision == "kv-usage"


def test_kv_layout_markdown_names_shape_and_bytes(rng):
    snap = make_snapshot(rng)
    md = F.kv_layout_markdown(snap.kv_layout, snap.block_size)
    assert "layers=2" in md and "block_size=4" in md and "float32" in md
    # K and V x 2 layers x 2 kv heads x 8 dims x 4 bytes = 256 B per token, 4 tokens per block
    assert "| 256 B | 1.0 KiB | 12.0 KiB |" in md


def test_kv_block_figure_shape_and_symmetric_range(rng):
    data = rng.normal(size=(4, 8)).astype(np.float32)
    fig = F.kv_block_figure(data, 3, 1, 0, "k", ["a", "b\n"])
    hm = fig.data[0]
    assert np.asarray(hm.z).shape == (4, 8)
    assert hm.zmin == -hm.zmax == -float(np.abs(data).max())
    assert list(hm.y)[:2] == ["0: a", "1: b⏎"] and list(hm.y)[3] == "3: (empty)"


# ---- Layers ---------------------------------------------------------------------------------

def test_norms_figure_is_layer_by_token_with_prompt_colour_range(rng):
    tr = make_trace(rng)
    fig = F.norms_figure(tr, token=7)
    hm = fig.data[0]
    assert np.asarray(hm.z).shape == (tr.num_layers + 1, 10)
    assert list(hm.y) == ["embed", "L0", "L1", "L2"]
    prompt = tr.norms()[:6]
    assert hm.zmin == pytest.approx(prompt.min())
    assert hm.zmax == pytest.approx(np.percentile(prompt, 99))
    assert fig.layout.uirevision == "norms-req-0"
    assert len(fig.layout.shapes) == 2         # prompt boundary and chosen token


def test_norms_figure_marks_prefix_cached_tokens_and_ignores_their_nan_rows(rng):
    tr = make_trace(rng)
    for i in range(3):             # the engine writes NaN rows for prefix-cache hits
        tr.resid_norms[i] = np.full(tr.num_layers + 1, np.nan, np.float32)
    fig = F.norms_figure(tr)
    hm = fig.data[0]
    live = tr.norms()[3:6]
    assert hm.zmin == pytest.approx(live.min()) and np.isfinite(hm.zmax)
    spans = [(s.x0, s.x1) for s in fig.layout.shapes if s.type == "rect"]
    assert spans == [(-0.5, 2.5)]
    assert "prefix cache" in fig.layout.annotations[0].text


def test_norms_figure_without_tokens_says_so():
    from engine.probes.trace import RequestTrace
    fig = F.norms_figure(RequestTrace("r", 2))
    assert "No tokens" in fig.layout.annotations[0].text


def test_logit_lens_figure_layer_by_step_with_top_token_text(rng):
    tr = make_trace(rng, num_out=5)
    fig = F.logit_lens_figure(tr, decode, token=tr.lens[1].position)
    hm = fig.data[0]
    assert np.asarray(hm.z).shape == (tr.num_layers, len(tr.lens))
    assert hm.zmin == 0 and hm.zmax == 1
    assert hm.text[0][0] == figures_layers.short_text(decode([int(tr.lens[0].top_ids[0, 0])]), 8)
    assert len(fig.layout.shapes) == 1


def test_attention_heads_figure_one_row_per_head_over_context(rng):
    tr = make_trace(rng)
    step = F.attention_step_for(tr, None)
    fig = F.attention_heads_figure(step, 1, tr.token_texts, head=2, request_id="req-0")
    hm = fig.data[0]
    assert np.asarray(hm.z).shape == (4, step.position + 1)
    assert np.allclose(np.asarray(hm.z) ** 2, step.probs[1], atol=1e-6)
    assert hm.zmin == 0 and hm.zmax == 1 and len(fig.layout.shapes) == 1


def test_attention_step_for_picks_the_row_of_the_scrubbed_token(rng):
    tr = make_trace(rng)
    assert F.attention_step_for(tr, 7).position == 7
    assert F.attention_step_for(tr, 2).position == tr.attention[0].position
    assert F.attention_step_for(tr, None) is tr.attention[-1]


def test_attention_row_figure_labels_tokens_and_block_mass_sums_to_one(rng):
    tr = make_trace(rng)
    step = tr.attention[-1]
    fig = F.attention_row_figure(step, 0, 3, tr.token_texts)
    row, mass = fig.data
    assert list(row.x)[0] == "0:tok0" and len(row.x) == step.position + 1
    assert list(mass.x) == [f"blk {b}" for b in step.block_table]
    assert float(np.sum(mass.y)) == pytest.approx(1.0, abs=1e-5)


def test_attention_row_survives_a_block_table_shorter_than_the_context(rng):
    tr = make_trace(rng)
    step = tr.attention[-1]
    step.block_table = step.block_table[:1]
    fig = F.attention_row_figure(step, 0, 0, tr.token_texts)
    mass = fig.data[1]
    assert list(mass.x)[0] == "blk 10" and len(mass.x) == -(-(step.position + 1) // 4)
    assert float(np.sum(mass.y)) == pytest.approx(1.0, abs=1e-5)


def test_routing_figure_marks_topk_experts(rng):
    tr = make_trace(rng, moe_experts=8)
    fig = F.routing_figure(tr, 3, 8)
    hm, marks = fig.data
    assert np.asarray(hm.z).shape == (3, 8)
    assert list(marks.x) == list(tr.router_topk_ids[3].reshape(-1))
    assert tuple(fig.layout.xaxis.range) == (-0.5, 7.5)


def test_routing_and_expert_load_say_when_model_is_dense(rng):
    tr = make_trace(rng)
    assert "dense" in F.routing_figure(tr, 0, 0).layout.annotations[0].text
    assert "dense" in F.expert_load_figure(None).layout.annotations[0].text


def test_expert_load_is_relative_to_even_split(rng):
    load = np.array([[4, 0, 0, 0], [1, 1, 1, 1]])
    fig = F.expert_load_figure(load, [1, 3])
    z = np.asarray(fig.data[0].z)
    assert z.tolist() == [[4, 0, 0, 0], [1, 1, 1, 1]]
    assert list(fig.data[0].y) == ["L1", "L3"] and fig.data[0].zmax == 4


# ---- Engine ---------------------------------------------------------------------------------

def test_batch_timeline_rows_are_requests_and_cells_mark_prefill(rng):
    snap = make_snapshot(rng)
    fig = F.batch_timeline_figure(snap.steps)
    prefill, decode_bar, hm = fig.data
    assert list(prefill.y) == [s.num_prefill_tokens for s in snap.steps]
    z = np.asarray(hm.z, dtype=float)
    assert list(hm.y) == ["req-0", "req-1"] and z.shape == (2, len(snap.steps))
    assert z[0, 0] == 2 and np.all(z[0, 1:] == 1) and np.all(z[1] == 1)
    last = snap.steps[-1].step_id
    assert tuple(fig.layout.xaxis.range) == (last - 63.5, last + 0.5)


def test_step_time_figure_stacks_four_phases_in_ms(rng):
    snap = make_snapshot(rng)
    fig = F.step_time_figure(snap.steps)
    assert [d.name for d in fig.data] == ["schedule", "prepare", "forward", "sample"]
    assert fig.data[2].y[0] == pytest.approx(1e3 * snap.steps[0].t_forward)
    assert fig.layout.barmode == "stack"


def test_cuda_graph_figure_splits_graph_and_eager_steps(rng):
    snap = make_snapshot(rng)
    fig = F.cuda_graph_figure(snap.steps)
    graph, eager, _ = fig.data
    assert len(graph.x) == len(snap.steps) - 1 and list(eager.x) == [snap.steps[0].step_id]
    assert "90%" in fig.layout.title.text


def test_tp_map_places_each_head_on_its_rank(rng):
    snap = make_snapshot(rng, tp=2)
    fig = F.tp_map_figure(snap.tp_layout, snap.num_heads, snap.num_kv_heads)
    q = [d for d in fig.data if d.type == "scatter" and d.xaxis == "x"]
    assert [list(d.x) for d in q] == [[0, 1], [2, 3]]
    assert [d.y[0] for d in q] == ["rank 0", "rank 1"]
    bars = [d for d in fig.data if d.type == "bar"]
    assert [tuple(b.base) for b in bars] == [(0,), (32,)]


def test_every_figure_sets_uirevision(rng):
    snap, tr = make_snapshot(rng, moe=True), make_trace(rng, moe_experts=8)
    figs = [F.kv_usage_figure(snap, [], 1000.0), F.norms_figure(tr), F.logit_lens_figure(tr, decode),
            F.attention_heads_figure(tr.attention[-1], 0, tr.token_texts),
            F.attention_row_figure(tr.attention[-1], 0, 0, tr.token_texts),
            F.routing_figure(tr, 0, 8), F.expert_load_figure(snap.steps[-1].expert_load),
            F.batch_timeline_figure(snap.steps), F.step_time_figure(snap.steps),
            F.cuda_graph_figure(snap.steps), F.tp_map_figure(snap.tp_layout, 4, 2)]
    assert all(f.layout.uirevision for f in figs)
