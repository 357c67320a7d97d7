"""Figure builders on synthetic snapshots and traces, drawn from a fresh random seed each run
(printed; GLASSBOX_TEST_SEED=n replays one): the KV block map's payload (read the way
views/kv_map.js draws it), plotly figure dicts (shapes, labels, colours, fixed ranges,
uirevision), the Layers tab's canvas chart specs (the fields views/canvas_chart.js reads) and
the Engine tab's (views/step_chart.js)."""
import json
import re
from collections import Counter

import numpy as np
import pytest

from ui_helpers import make_snapshot, make_trace  # noqa: I001  (puts the repo on sys.path)
from figure_helpers import (check_chart_spec, check_plotly_figure, decode, drawn_ids, live_ids,
                            map_cells, random_cache, seeded_rng, strict_json,
                            unpack_map, kv_map_lists)

from engine.records import StepEntries, StepEntry
from engine.probes.trace import RequestTrace
from views import figures as F
from views.canvas_chart import chart_value, empty_chart
from views.figures_common import EVICTABLE_COLOUR, FREE_COLOUR, PALETTE, PHASE_COLOURS
from views.figures_kv import MAP_MIN_CELLS, MAP_ROW, MAX_MAP_CELLS
from views.figures_layers import MAX_LENS_STEPS
from views.kv_cache import map_value
from views.live_plot import plot_value


@pytest.fixture
def rng(request):
    return seeded_rng(request)


def trace(rng, **kw):
    """make_trace with a random prompt and reply length (at least 3 tokens of each)."""
    kw.setdefault("num_prompt", int(rng.integers(3, 14)))
    kw.setdefault("num_out", int(rng.integers(3, 14)))
    return make_trace(rng, **kw)


# ---- expected values, from the figures' specification (never from the code under test) --------
def expected_state(b) -> str:
    """The map's legend: a block referenced by several requests is shared, by one owned; an
    unreferenced block whose tokens stay cached for prefix hits is evictable; the rest free."""
    if b.ref_count > 1:
        return "shared"
    if b.ref_count == 1:
        return "owned"
    return "evictable" if b.evictable else "free"


def expected_colour(request_id: str) -> str:
    """Sequential ids `req-N` take the palette's colours in turn."""
    return PALETTE[int(request_id.rsplit("-", 1)[1]) % len(PALETTE)]


def expected_label(text: str, limit: int) -> str:
    """An axis label: at most `limit` characters, a cut one ending in an ellipsis (the texts
    here have no whitespace to make visible)."""
    assert text.strip() == text
    return text if len(text) <= limit else text[:limit - 1] + "…"


# ---- KV cache: the block map ----------------------------------------------------------------

def test_kv_map_has_one_cell_per_block_with_its_state(rng):
    snap = make_snapshot(rng)        # blocks 0-1 shared, 2-3 owned, 4 evictable, the rest free
    cells = map_cells(F.kv_map_data(snap))
    assert list(cells) == list(range(snap.num_blocks))
    assert cells[0].state == cells[1].state == "shared"
    assert cells[2].state == cells[3].state == "owned"
    assert cells[4].state == "evictable"
    assert all(cells[i].state == "free" for i in range(5, snap.num_blocks))

    n = int(rng.integers(40, MAP_MIN_CELLS + 1))          # a small cache is drawn whole
    snap = random_cache(rng, n, busy=int(rng.integers(8, n // 2)),
                        evictable=int(rng.integers(1, n // 4)),
                        block_size=int(rng.choice([4, 8, 16])))
    version = int(rng.integers(1, 1 << 30))
    payload = F.kv_map_data(snap, version)
    cells = map_cells(payload)
    assert list(cells) == list(range(n)) and payload["shown"] == n
    assert {i: c.state for i, c in cells.items()} == \
        {b.block_id: expected_state(b) for b in snap.blocks}
    # free blocks are implied, never listed; the legend counts every block once
    assert sorted(payload["ids"]) == sorted(b.block_id for b in snap.blocks
                                            if expected_state(b) != "free")
    assert payload["counts"] == {**dict.fromkeys(["free", "evictable", "owned", "shared"], 0),
                                 **Counter(expected_state(b) for b in snap.blocks)}
    assert (payload["version"], payload["num_blocks"], payload["block_size"]) == \
        (version, n, snap.block_size)


def test_kv_map_derives_fill_and_owners_from_the_block_tables(rng):
    # the engine hands out arrays and tables, never a record per block: every block's fill
    # and owners come from the tables and each request's computed tokens
    n = int(rng.integers(300, 3000))
    snap = random_cache(rng, n, busy=int(rng.integers(50, 250)), evictable=int(rng.integers(0, 40)),
                        block_size=int(rng.choice([1, 4, 16])), shared_frac=0.3)
    a = snap.kv_arrays
    for b in snap.blocks:                       # the truth random_cache drew
        assert a.filled[b.block_id] == b.num_filled, b
        owners = a.more_owners.get(b.block_id) or ([a.owner[b.block_id]]
                                                    if a.owner[b.block_id] >= 0 else [])
        assert [a.owners[i] for i in owners] == b.owners, b
    payload = F.kv_map_data(snap)
    assert sum(payload["counts"].values()) == snap.num_blocks
    assert payload["counts"]["free"] == sum(expected_state(b) == "free" for b in snap.blocks)


def test_kv_map_draws_the_region_in_use_and_every_block_past_it_is_free(rng):
    n = int(rng.integers(1000, 4097))
    top = int(rng.integers(MAP_MIN_CELLS + 40, n - 100))     # highest busy block
    ids = np.concatenate([[top], rng.choice(top, int(rng.integers(20, 120)), replace=False)])
    snap = random_cache(rng, n, busy=len(ids) - 5, evictable=5, ids=ids)
    payload = F.kv_map_data(snap)
    shown = payload["shown"]
    assert shown % MAP_ROW == 0 and top < shown <= top + MAP_ROW     # a whole row past it
    assert all(i < shown for i in payload["ids"])
    cells = map_cells(payload)
    assert list(cells) == list(range(shown))
    assert {i: c.state for i, c in cells.items()} == \
        {b.block_id: expected_state(b) for b in snap.blocks[:shown]}
    assert all(expected_state(b) == "free" for b in snap.blocks[shown:])
    # a big cache with little in use still draws MAP_MIN_CELLS blocks, not a sliver
    small = random_cache(rng, n, busy=3, ids=rng.choice(40, 3, replace=False))
    assert F.kv_map_data(small)["shown"] == MAP_MIN_CELLS


def test_kv_map_colours_owner_fill_and_evictable_grey(rng):
    snap = make_snapshot(rng)
    cells = map_cells(F.kv_map_data(snap))
    c0, c1 = PALETTE[0], PALETTE[1]
    assert c0 != c1
    assert cells[0].colour == c0 and cells[0].fill == snap.block_size   # full block
    assert cells[2].colour == c0 and cells[2].fill == 3                  # 3 of 4 slots written
    assert cells[3].colour == c1 and cells[3].fill == 1
    assert cells[4].colour == EVICTABLE_COLOUR and cells[5].colour == FREE_COLOUR

    snap = random_cache(rng, 256, busy=int(rng.integers(30, 150)), evictable=20,
                        num_requests=int(rng.integers(3, 16)))
    k = int(rng.integers(1, len(snap.running)))
    snap.waiting, snap.running = snap.running[:k], snap.running[k:]   # preempted ones wait
    payload = F.kv_map_data(snap)
    cells = map_cells(payload)
    for b in snap.blocks:
        c = cells[b.block_id]
        if b.ref_count:
            assert c.colour == expected_colour(b.owners[0]), b      # coloured by its owner
            assert (c.owners, c.ref, c.fill) == (b.owners, b.ref_count, b.num_filled)
        else:
            assert c.colour == (EVICTABLE_COLOUR if b.evictable else FREE_COLOUR)
    assert payload["colours"] == [expected_colour(r) for r in payload["owners"]]
    assert payload["running"] == [r in snap.running for r in payload["owners"]]
    # sequential ids get distinct colours: same colour only 16 apart (the palette's length)
    for a, ca in zip(payload["owners"], payload["colours"]):
        for b, cb in zip(payload["owners"], payload["colours"]):
            assert (ca == cb) == (int(a[4:]) % len(PALETTE) == int(b[4:]) % len(PALETTE))


def test_kv_map_hover_card_shows_id_state_refcount_owners_and_decoded_text(rng):
    snap = random_cache(rng, 128, busy=40, evictable=10, shared_frac=0.5)
    bs = snap.block_size
    shared = next(snap.blocks[i] for i in rng.permutation(128) if snap.blocks[i].ref_count > 1)
    tip = F.block_detail(shared, bs, decode)          # the card reads LLM.block_info(id)
    assert f"block {shared.block_id} · shared · ref {shared.ref_count}" in tip
    assert f"owners: {', '.join(shared.owners)}" in tip and decode(shared.token_ids) in tip
    assert f"filled {shared.num_filled}/{bs}" in tip
    assert f"hash {shared.prefix_hash & 0xffffffff:08x}" in tip
    # the payload names the same owners for the canvas' own short card
    assert map_cells(F.kv_map_data(snap))[shared.block_id].owners == shared.owners
    cached = next(b for b in snap.blocks if b.evictable)
    tip = F.block_detail(cached, bs, decode)
    assert "evictable · ref 0" in tip and "owners: —" in tip and decode(cached.token_ids) in tip
    free = next(b for b in snap.blocks if expected_state(b) == "free")
    assert F.block_detail(free, bs, decode) == f"block {free.block_id} · free"


def test_kv_map_of_a_10000_block_cache_draws_every_block_of_a_running_request(rng):
    # issue requirement "Never hide a live block": live blocks anywhere in a 10,000-block cache
    # (the last one included), among thousands of cached-free ones, are all drawn
    n = 10_000
    busy, evictable = int(rng.integers(100, 600)), int(rng.integers(2000, 6000))
    rest = rng.permutation(n - 1)[:busy + evictable - 1]
    snap = random_cache(rng, n, busy=busy, evictable=evictable, ids=np.r_[n - 1, rest])
    payload = F.kv_map_data(snap)
    cells = map_cells(payload)
    owned_by_running = {b for r in snap.running for b in snap.block_tables[r]}
    assert n - 1 in owned_by_running and len(owned_by_running) == busy
    assert owned_by_running <= set(cells)
    for b in (snap.blocks[i] for i in owned_by_running):
        c = cells[b.block_id]
        assert (c.state, c.owners, c.colour) == (expected_state(b), b.owners,
                                                 expected_colour(b.owners[0]))
    assert payload["counts"]["owned"] + payload["counts"]["shared"] == busy
    assert sum(payload["counts"].values()) == n


def test_kv_map_past_its_cell_cap_keeps_every_live_block_and_drops_only_cached_ones(rng):
    n = 40_000
    busy = int(rng.integers(500, MAX_MAP_CELLS // 2))
    evictable = MAX_MAP_CELLS + int(rng.integers(100, 5000))
    snap = random_cache(rng, n, busy=busy, evictable=evictable, shared_frac=0.01)
    payload = F.kv_map_data(snap)
    drawn = drawn_ids(payload)
    assert payload["shown"] is None and len(drawn) == MAX_MAP_CELLS
    assert drawn == sorted(drawn)                     # the canvas draws them in id order
    assert live_ids(snap) <= set(drawn)
    assert payload["counts"]["evictable"] == evictable       # the legend still counts them all
    # live blocks alone past the cap: all of them, no cached one
    busy = MAX_MAP_CELLS + int(rng.integers(1, 2000))
    snap = random_cache(rng, n, busy=busy, evictable=int(rng.integers(100, 3000)),
                        shared_frac=0.002)
    cells = map_cells(F.kv_map_data(snap))
    assert set(cells) == live_ids(snap)
    assert all(c.state in ("owned", "shared") for c in cells.values())


def test_kv_map_payload_of_a_full_4096_block_cache_is_small(rng):
    # The map's value goes to the browser on every tick the cache changes and the page parses
    # it on its main thread. The old per-cell HTML grid (kv_grid_html: a div with a style and
    # a tooltip per block) was ~1-1.5 MB for a full 4,096-block cache, which is what made the
    # KV tab stall on two cores. The compact payload lists only non-free blocks in parallel
    # arrays (~20 bytes each, owners' text fetched on hover), so even a cache where every
    # block is in use, many shared by up to 8 of 64 requests, stays near 90 kB: 150 kB leaves
    # room for longer request ids, and is still a tenth of the HTML.
    snap = random_cache(rng, 4096, busy=4096 - 800, evictable=800, num_requests=64,
                        shared_frac=0.3, max_owners=8)
    value = map_value(snap, version=int(rng.integers(1 << 30)))
    payload = unpack_map(value)
    assert payload == kv_map_lists(F.kv_map_data(snap, payload["version"]))   # nothing lost
    assert payload["ids"] == [b.block_id for b in snap.blocks]
    assert len(value) < 150_000, len(value)


def test_kv_map_of_a_huge_cache_keeps_every_shared_blocks_owners(rng):
    """Past the cell cap the map keeps every live block and the owner lists of exactly the
    shared blocks it kept (no timing here: the quadratic filter this once had is gone)."""
    snap = random_cache(rng, 30_000, busy=6000, evictable=MAX_MAP_CELLS, shared_frac=0.5)
    payload = F.kv_map_data(snap)
    assert live_ids(snap) <= set(drawn_ids(payload))
    kept = set(payload["ids"])
    shared = {b.block_id for b in snap.blocks if len(b.owners) > 1 and b.block_id in kept}
    assert {int(k) for k in payload["more_owners"]} == shared


# ---- KV cache: tables, usage, layout, drilldown -----------------------------------------------

def test_block_tables_list_physical_ids_and_mark_shared(rng):
    snap = make_snapshot(rng)
    html = F.block_tables_html(snap)
    rows = re.findall(r'data-request="([^"]+)"', html)
    assert rows == ["req-0", "req-1"]
    row0 = html.split('data-request="req-0"')[1].split('data-request="req-1"')[0]
    assert re.findall(r'>(\d+)</span>', row0) == ["0", "1", "2"]
    assert row0.count("kv-tshared") == 2
    snap = random_cache(rng, 200, busy=60, shared_frac=0.4, num_requests=6)
    html = F.block_tables_html(snap)
    ref = {b.block_id: b.ref_count for b in snap.blocks}
    for rid, table in snap.block_tables.items():
        row = html.split(f'data-request="{rid}"')[1].split('data-request=')[0]
        assert re.findall(r'>(\d+)</span>', row) == [str(b) for b in table]
        assert row.count("kv-tshared") == sum(ref[b] > 1 for b in table)
        assert f"border-color:{expected_colour(rid)}" in row


def test_kv_usage_figure_has_fixed_axes_and_uirevision(rng):
    snap = make_snapshot(rng, num_steps=int(rng.integers(3, 30)))
    now = snap.steps[-1].wall_time + float(rng.uniform(0.1, 5))
    hits = sorted((now - float(rng.uniform(0, 59)), float(rng.uniform(0, 1))) for _ in range(6))
    fig = F.kv_usage_figure(snap, [(now - 61 - float(rng.uniform(0, 9)), 0.9)] + hits, now)
    usage, hit = fig["data"]
    assert usage["x"] == pytest.approx([s.wall_time - now for s in snap.steps])
    assert usage["y"] == [s.kv_usage for s in snap.steps]
    assert hit["y"] == [r for _, r in hits]          # older than the window: left out
    lay = fig["layout"]
    assert lay["yaxis"]["range"] == [0, 1.02] and lay["xaxis"]["range"] == [-60, 0]
    assert lay["uirevision"] == "kv-usage"


def test_kv_layout_markdown_names_shape_and_bytes(rng):
    snap = make_snapshot(rng)
    md = F.kv_layout_markdown(snap.kv_layout, snap.block_size)
    assert "layers=2" in md and "block_size=4" in md and "float32" in md
    # K and V x 2 layers x 2 kv heads x 8 dims x 4 bytes = 256 B per token, 4 tokens per block
    assert "| 256 B | 1.0 KiB | 12.0 KiB |" in md


def test_kv_block_figure_shape_and_symmetric_range(rng):
    bs, dim = int(rng.integers(4, 33)), int(rng.integers(8, 129))
    data = (rng.normal(size=(bs, dim)) * rng.uniform(0.1, 10)).astype(np.float32)
    peak = np.unravel_index(np.abs(data).argmax(), data.shape)
    for sign in (1, -1):            # the largest magnitude positive, then negative
        data[peak] = sign * abs(data[peak])
        hm = F.kv_block_figure(data, 3, 1, 0, "k")["data"][0]
        assert hm["zmin"] == -hm["zmax"] == -float(np.abs(data).max()) and hm["zmid"] == 0
    fig = F.kv_block_figure(data, 3, 1, 0, "k", ["a", "b\n", "<b>x</b>"])
    hm = fig["data"][0]
    assert np.array_equal(np.asarray(hm["z"]), data)
    assert hm["y"][:3] == ["0: a", "1: b⏎", "2: &lt;b&gt;x&lt;/b&gt;"]    # markup shown as text
    assert hm["y"][bs - 1] == f"{bs - 1}: (empty)" and len(hm["y"]) == bs
    assert fig["layout"]["uirevision"]


# ---- Layers (canvas chart specs) --------------------------------------------------------------

def test_norms_chart_is_layer_by_token_with_prompt_colour_range(rng):
    tr = trace(rng)
    t, n_prompt = len(tr.resid_norms), len(tr.prompt_token_ids)
    token = int(rng.integers(0, t))
    spec = F.norms_figure(tr, token=token)
    check_chart_spec(spec)
    assert spec["kind"] == "heatmap"
    assert np.array_equal(np.asarray(spec["z"]), tr.norms().T)          # [layers + 1, tokens]
    assert spec["y_labels"] == ["embed", "L0", "L1", "L2"]
    prompt = tr.norms()[:n_prompt]
    assert spec["zmin"] == pytest.approx(prompt.min())
    assert spec["zmax"] == pytest.approx(np.percentile(prompt, 99))
    assert spec["vlines"] == [{"at": n_prompt, "colour": "#ffffff", "label": "reply →"}]  # labelled
    assert [(m["from"], m["to"]) for m in spec["col_outlines"]] == [(token, token + 1)]
    assert spec["x_labels"] == [f"{i}:tok{i}" for i in range(t)]
    # the x axis ends on a step (16, then multiples of 32), not on the newest token: it stays
    # put while tokens stream in
    assert spec["x_end"] == (16 if t <= 16 else 32)
    assert F.norms_figure(tr, token=t)["col_outlines"] == []
    # a finished reply's axis ends on its last token: nothing more will stream in
    tr.finished = True
    assert F.norms_figure(tr, token=token)["x_end"] == t


def test_attention_heads_key_axis_ends_on_the_context_once_the_reply_is_finished(rng):
    tr = trace(rng)
    step = F.attention_step_for(tr, None)
    ctx = step.position + 1
    streaming = F.attention_heads_figure(step, step.layers[0], tr.token_texts, 0, "r")
    assert streaming["x_end"] >= ctx and streaming["x_end"] % 16 == 0
    done = F.attention_heads_figure(step, step.layers[0], tr.token_texts, 0, "r",
                                    streaming=False)
    assert done["x_end"] == ctx


def test_norms_chart_marks_prefix_cached_tokens_and_ignores_their_nan_rows(rng):
    tr = trace(rng, num_prompt=int(rng.integers(5, 14)))
    k = int(rng.integers(1, len(tr.prompt_token_ids) - 1))
    for i in range(k):             # the engine writes NaN rows for prefix-cache hits
        tr.resid_norms[i] = np.full(tr.num_layers + 1, np.nan, np.float32)
    spec = F.norms_figure(tr)
    check_chart_spec(spec)
    live = tr.norms()[k:len(tr.prompt_token_ids)]
    assert spec["zmin"] == pytest.approx(live.min()) and np.isfinite(spec["zmax"])
    assert spec["zmax"] == pytest.approx(np.percentile(live, 99))
    assert [(s["from"], s["to"]) for s in spec["spans"]] == [(0, k)]
    assert "prefix cache" in spec["spans"][0]["label"]
    z = strict_json(chart_value(spec))["z"]          # NaN reaches the canvas as null
    assert all(row[i] is None for row in z for i in range(k))
    assert all(row[i] is not None for row in z for i in range(k, len(tr.resid_norms)))


def test_norms_chart_without_tokens_says_so():
    spec = F.norms_figure(RequestTrace("r", 2))
    check_chart_spec(spec)
    assert "No tokens" in spec["message"]


def test_logit_lens_chart_layer_by_step_with_top_token_text(rng):
    tr = trace(rng)
    pick = int(rng.integers(0, len(tr.lens)))
    spec = F.logit_lens_figure(tr, decode, token=tr.lens[pick].position)
    check_chart_spec(spec)
    z = np.asarray(spec["z"])
    assert z.shape == (tr.num_layers, len(tr.lens))
    assert np.array_equal(z, np.stack([s.top_probs[:, 0] for s in tr.lens], axis=1))
    assert spec["zmin"] == 0 and spec["zmax"] == 1
    assert spec["cell_text"] == [[expected_label(decode([int(s.top_ids[l, 0])]), 8) for s in tr.lens]
                                 for l in range(tr.num_layers)]
    assert spec["x_values"] == [s.position for s in tr.lens]       # a click scrubs to these
    assert [(m["from"], m["to"]) for m in spec["col_outlines"]] == [(pick, pick + 1)]
    s, l = tr.lens[pick], int(rng.integers(tr.num_layers))
    hover = F.lens_hover_text(spec, l, pick)        # what the page writes from lens_hover
    q = lambda t: json.dumps(t, ensure_ascii=False)     # noqa: E731
    guesses = ", ".join(f"{q(decode([int(i)]))} {p:.2f}" for i, p in zip(s.top_ids[l], s.top_probs[l]))
    assert hover.startswith(f"next-token guesses: {guesses}\n")
    assert f"sampled {q(decode([s.sampled_token]))}: rank {int(s.sampled_rank[l])}" in hover
    assert f"entropy {float(s.entropy[l]):.2f} nats" in hover
    assert "No generated tokens" in F.logit_lens_figure(RequestTrace("r", 2), decode)["message"]


def test_logit_lens_window_follows_the_scrubbed_token_of_a_long_reply(rng):
    tr = trace(rng, num_out=int(rng.integers(40, 80)))
    pick = int(rng.integers(0, len(tr.lens) - MAX_LENS_STEPS))     # older than the newest 24
    spec = F.logit_lens_figure(tr, decode, token=tr.lens[pick].position)
    check_chart_spec(spec)
    xs = spec["x_values"]
    assert len(xs) == MAX_LENS_STEPS and xs == list(range(xs[0], xs[0] + len(xs)))
    assert tr.lens[pick].position in xs
    j = xs.index(tr.lens[pick].position)
    assert j == min(pick, MAX_LENS_STEPS // 2)                 # centred where it can be
    assert [(m["from"], m["to"]) for m in spec["col_outlines"]] == [(j, j + 1)]
    assert F.logit_lens_figure(tr, decode)["x_values"][-1] == tr.lens[-1].position   # newest


def test_attention_heads_chart_one_row_per_head_over_context(rng):
    tr = trace(rng)
    step = F.attention_step_for(tr, None)
    step.layers = sorted(int(x) for x in rng.choice(range(10, 40), len(step.layers),
                                                    replace=False))
    for j, layer in enumerate(step.layers):       # captured layers by id, not by index
        z = np.asarray(F.attention_heads_figure(step, layer, tr.token_texts)["z"])
        assert z.shape == (4, step.position + 1)
        assert np.allclose(z ** 2, step.probs[j], atol=1e-6)      # sqrt scale, p in hover
    head = int(rng.integers(4))
    spec = F.attention_heads_figure(step, step.layers[-1], tr.token_texts, head=head,
                                    request_id="req-0")
    check_chart_spec(spec)
    assert spec["value_fmt"] == "p" and spec["zmin"] == 0 and spec["zmax"] == 1
    assert [(m["from"], m["to"]) for m in spec["row_outlines"]] == [(head, head + 1)]
    assert spec["y_labels"] == [f"h{i}" for i in range(4)]
    missing = int(rng.integers(0, 10))
    assert "not captured" in F.attention_heads_figure(step, missing, tr.token_texts)["message"]


def test_attention_step_for_picks_the_row_of_the_scrubbed_token(rng):
    tr = trace(rng)
    pick = tr.attention[int(rng.integers(len(tr.attention)))]
    assert F.attention_step_for(tr, pick.position) is pick
    assert F.attention_step_for(tr, None) is tr.attention[-1]
    # an early prompt token: no row captured, and none made up from another token's
    early = int(rng.integers(0, tr.attention[0].position))
    assert F.attention_step_for(tr, early) is None
    # ... unless the whole prompt's pattern was recorded: that row of it
    p = len(tr.prompt_token_ids)
    pats = {l: rng.dirichlet(np.ones(p), (4, p)).astype(np.float32) for l in (0, 2)}
    tr.prefill_pattern = pats
    tr.prefill_computed = np.ones(p, bool)
    st = F.attention_step_for(tr, early)
    assert st.position == early and st.layers == [0, 2]
    assert np.array_equal(st.probs, np.stack([pats[l][:, early, :early + 1] for l in (0, 2)]))
    assert st.block_table == tr.attention[0].block_table[:early // st.block_size + 1]


def test_attention_step_for_a_prefix_cached_prompt_token_is_none(rng):
    tr = trace(rng, num_prompt=int(rng.integers(6, 14)))
    p = len(tr.prompt_token_ids)
    k = int(rng.integers(1, p - 1))                  # tokens 0..k-1 came from the prefix cache
    pat = rng.dirichlet(np.ones(p), (4, p)).astype(np.float32)
    pat[:, :k] = np.nan                              # as ProbeManager._fold_patterns leaves them
    tr.prefill_pattern = {0: pat}
    tr.prefill_computed = np.arange(p) >= k
    cached = int(rng.integers(0, k))
    assert F.attention_step_for(tr, k) is not None
    assert F.attention_step_for(tr, cached) is None


def test_attention_row_chart_labels_tokens_and_block_mass_sums_to_one(rng):
    tr = trace(rng)
    step = tr.attention[int(rng.integers(len(tr.attention)))]
    for layer in range(tr.num_layers):
        for head in range(4):
            row, mass = F.attention_row_figure(step, layer, head, tr.token_texts)["panels"]
            assert np.array_equal(row["values"], step.probs[layer, head])
            assert np.allclose(mass["values"], step.block_mass()[layer, head])
    layer, head = int(rng.integers(tr.num_layers)), int(rng.integers(4))
    spec = F.attention_row_figure(step, layer, head, tr.token_texts)
    check_chart_spec(spec)
    row, mass = spec["panels"]
    assert row["labels"][0] == "0:tok0" and len(row["values"]) == step.position + 1
    assert row["hover"][-1] == f"key {step.position} “tok{step.position}”"
    assert mass["labels"] == [f"blk {b}" for b in step.block_table]
    assert float(np.sum(mass["values"])) == pytest.approx(1.0, abs=1e-5)
    for p in (row, mass):     # the y axis tops out on the first fixed step above the peak
        assert p["ymax"] == min(y for y in (0.05, 0.1, 0.25, 0.5, 1.0) if y >= max(p["values"]))


def test_attention_row_survives_a_block_table_shorter_than_the_context(rng):
    tr = trace(rng, num_prompt=int(rng.integers(6, 14)))
    step = tr.attention[-1]
    step.block_table = step.block_table[:1]
    spec = F.attention_row_figure(step, 0, 0, tr.token_texts)
    check_chart_spec(spec)
    mass = spec["panels"][1]
    assert mass["labels"][0] == "blk 10" and len(mass["values"]) == -(-(step.position + 1) // 4)
    assert float(np.sum(mass["values"])) == pytest.approx(1.0, abs=1e-5)


def test_routing_chart_marks_topk_experts(rng):
    e = int(rng.choice([8, 16, 64]))
    tr = trace(rng, moe_experts=e)
    token = int(rng.integers(len(tr.router_probs)))
    spec = F.routing_figure(tr, token, e)
    check_chart_spec(spec)
    z = np.asarray(spec["z"])
    assert z.shape == (3, e) and np.allclose(z ** 2, tr.router_probs[token], atol=1e-6)
    assert spec["markers"] == [[i, int(x)] for i in range(3) for x in tr.router_topk_ids[token][i]]
    assert spec["x_end"] == e and spec["y_labels"] == ["L0", "L1", "L2"]
    assert f"token {token} “tok{token}”" in spec["title"]


def test_routing_chart_of_a_prefix_cached_token_circles_no_expert(rng):
    tr = trace(rng, moe_experts=8)
    k = int(rng.integers(1, len(tr.prompt_token_ids)))
    for i in range(k):             # ProbeManager's _put: NaN probabilities, -1 expert ids
        tr.router_probs[i] = np.full_like(tr.router_probs[i], np.nan)
        tr.router_topk_ids[i] = np.full_like(tr.router_topk_ids[i], -1)
        tr.router_topk_weights[i] = np.full_like(tr.router_topk_weights[i], np.nan)
    spec = F.routing_figure(tr, int(rng.integers(k)), 8)
    assert all(0 <= c < 8 for _, c in spec.get("markers", []))


def test_routing_and_expert_load_say_when_model_is_dense(rng):
    tr = trace(rng)
    assert "dense" in F.routing_figure(tr, 0, 0)["message"]
    assert "dense" in F.expert_load_figure(None)["message"]
    assert "dense" in F.expert_load_figure(np.zeros((0, 8)))["message"]


def test_expert_load_is_relative_to_even_split(rng):
    m, e = int(rng.integers(1, 6)), int(rng.choice([4, 8, 60]))
    load = rng.integers(1, 50, (m, e))
    load[rng.integers(m), rng.integers(e)] = 0
    layers = sorted(int(x) for x in rng.choice(48, m, replace=False))
    spec = F.expert_load_figure(load, layers, num_steps=int(rng.integers(2, 40)))
    check_chart_spec(spec)
    even = load.sum(1, keepdims=True) / e
    assert np.allclose(spec["z"], load / even)
    assert spec["y_labels"] == [f"L{l}" for l in layers]
    assert spec["zmin"] == 0 and spec["zmax"] == 4           # fixed: 1 = an even share
    assert spec["cell_hover"] == [[f"{v} tokens" for v in row] for row in load.tolist()]
    assert "last" in spec["title"] and "latest step" in F.expert_load_figure(load)["title"]
    idle = load.copy()
    idle[0] = 0                                       # a layer no token reached: 0, not NaN
    assert np.asarray(F.expert_load_figure(idle)["z"])[0].tolist() == [0.0] * e


# ---- Engine ---------------------------------------------------------------------------------

def step_spans(steps):
    """The x span of each step on the Engine charts: [id - 0.5, id + 0.5)."""
    return [s.step_id - 0.5 for s in steps], [s.step_id + 0.5 for s in steps]


def check_step_chart(spec):
    """What views/step_chart.js reads: a title, a legend of (name, colour, style), one x span
    per point, every series as long as the points, cells inside the rows; strict JSON."""
    x = spec["x"]
    n = len(x["lo"])
    assert len(x["hi"]) == len(x["values"]) == n and x["range"][0] < x["range"][1]
    assert all(lo < hi for lo, hi in zip(x["lo"], x["hi"]))
    assert all(style in ("fill", "line", "dash") for _, _, style in spec["legend"])
    for p in spec["panels"]:
        for se in p.get("series", []) + p.get("lines", []):
            assert len(se["y"]) == n and re.fullmatch(r"#[0-9a-f]{6}", se["colour"])
        for i, row, kind, tokens, start in p.get("cells", []):     # the page writes the hover
            assert 0 <= i < n and 0 <= row < len(p["rows"]) and 0 <= kind < len(p["kinds"])
            assert type(kind) is int and tokens >= 1 and start >= 0
    strict_json(plot_value(spec))


def test_batch_timeline_rows_are_requests_and_cells_mark_prefill(rng):
    snap = make_snapshot(rng, num_steps=int(rng.integers(3, 100)))
    rids = [f"req-{i}" for i in rng.permutation(40)[:int(rng.integers(2, 8))]]
    for s in snap.steps:           # a random batch each step: who ran, prefill or decode
        batch = [r for r in rids if rng.random() < 0.6] or rids[:1]
        s.entries = [StepEntry(r, "prefill" if rng.random() < 0.3 else "decode",
                               int(rng.integers(1, 9)), int(rng.integers(0, 99))) for r in batch]
        s.num_prefill_tokens = sum(e.num_tokens for e in s.entries if e.kind == "prefill")
        s.num_decode_tokens = sum(e.num_tokens for e in s.entries if e.kind == "decode")
    spec = F.batch_timeline_figure(snap.steps)
    check_step_chart(spec)
    tokens, requests = spec["panels"]
    steps = snap.steps[-64:]
    prefill, decode_area = tokens["series"]
    assert prefill["y"] == [s.num_prefill_tokens for s in steps]
    assert decode_area["y"] == [s.num_decode_tokens for s in steps]
    assert [spec["x"]["lo"], spec["x"]["hi"]] == list(step_spans(steps))
    seen = list(dict.fromkeys(e.request_id for s in steps for e in s.entries))
    assert requests["rows"] == seen                                      # rows in order seen
    kinds = [k for k, _ in requests["kinds"]]
    want = {(j, seen.index(e.request_id), e.kind, e.num_tokens, e.start_pos)
            for j, s in enumerate(steps) for e in s.entries}
    assert {(j, r, kinds[k], n, pos) for j, r, k, n, pos in requests["cells"]} == want
    last = snap.steps[-1].step_id
    assert spec["x"]["range"] == [last - 63.5, last + 0.5]


def test_batch_timeline_shows_the_newest_requests_and_reads_each_step_once(rng):
    """Past MAX_TIMELINE_ROWS requests the rows are the newest ones in order seen, and every
    cell of theirs is there; a step's entries replaced by new ones (the same step id) are read
    again, never served from what was derived from the old ones."""
    from views.figures_engine import MAX_TIMELINE_ROWS
    snap = make_snapshot(rng, num_steps=int(rng.integers(20, 90)))
    rids = [f"r{rng.integers(1 << 30)}-{i}" for i in range(int(rng.integers(30, 80)))]

    def fill(steps):
        for k, s in enumerate(steps):
            lo = int(rng.integers(0, len(rids)))
            batch = rids[max(0, lo - 20):lo + 1]
            s.entries = StepEntries.of(
                StepEntry(r, "prefill" if rng.random() < 0.3 else "decode",
                          int(rng.integers(1, 9)), int(rng.integers(0, 999))) for r in batch)
    for _ in range(2):                  # the second time: same steps, new entries objects, the
        fill(snap.steps)                # requests in another order than first seen
        rids = [str(r) for r in rng.permutation(rids)]
        spec = F.batch_timeline_figure(snap.steps)
        requests = spec["panels"][1]
        steps = snap.steps[-64:]
        seen = list(dict.fromkeys(e.request_id for s in steps for e in s.entries))
        assert len(seen) > MAX_TIMELINE_ROWS
        rows = seen[-MAX_TIMELINE_ROWS:]
        assert requests["rows"] == rows
        kinds = [k for k, _ in requests["kinds"]]
        want = {(j, rows.index(e.request_id), e.kind, e.num_tokens, e.start_pos)
                for j, s in enumerate(steps) for e in s.entries if e.request_id in rows}
        got = [(j, r, kinds[k], n, pos) for j, r, k, n, pos in requests["cells"]]
        assert len(got) == len(want) and set(got) == want


def test_step_time_figure_stacks_four_phases_in_ms(rng):
    snap = make_snapshot(rng, num_steps=int(rng.integers(3, 100)))
    for s in snap.steps:
        s.t_schedule, s.t_prepare, s.t_sample = (float(x) for x in rng.uniform(1e-5, 2e-3, 3))
    spec = F.step_time_figure(snap.steps)
    check_step_chart(spec)
    steps = snap.steps[-64:]
    (panel,) = spec["panels"]
    assert [d["name"] for d in panel["series"]] == list(PHASE_COLOURS)
    for d in panel["series"]:
        assert d["y"] == pytest.approx([1e3 * getattr(s, f"t_{d['name']}") for s in steps])
    total = 1e3 * np.median([s.t_schedule + s.t_prepare + s.t_forward + s.t_sample
                             for s in steps])
    assert f"median {total:.1f} ms over the last {len(steps)} steps" in spec["title"]


def test_cuda_graph_figure_splits_graph_and_eager_steps(rng):
    snap = make_snapshot(rng, num_steps=int(rng.integers(10, 60)))
    eager = set(rng.choice(len(snap.steps), int(rng.integers(1, 6)), replace=False).tolist())
    for i, s in enumerate(snap.steps):
        s.graph_bucket = None if i in eager else int(rng.choice([1, 2, 4, 8]))
    spec = F.cuda_graph_figure(snap.steps)
    check_step_chart(spec)
    (panel,) = spec["panels"]
    graph, prefill_graph, eager_t = panel["series"]
    batch, cascade = panel["lines"]
    assert cascade["y"] == [0] * len(snap.steps) and "shared prefix" not in spec["title"]
    # 0: an eager step, or the other kind of graph (a prefill graph's bucket is its tokens)
    assert graph["y"] == [0 if s.num_prefill_tokens else s.graph_bucket or 0 for s in snap.steps]
    assert prefill_graph["y"] == [s.graph_bucket or 0 if s.num_prefill_tokens else 0
                                  for s in snap.steps]
    assert eager_t["y"] == [s.num_prefill_tokens + s.num_decode_tokens if i in eager else 0
                            for i, s in enumerate(snap.steps)]
    assert batch["y"] == [len(s.entries) for s in snap.steps]
    share = (len(snap.steps) - len(eager)) / len(snap.steps)
    assert f"{share:.0%} of recent steps replayed a graph" in spec["title"]


def test_the_engine_charts_say_which_steps_read_a_shared_prefix_once(rng):
    snap = make_snapshot(rng, num_steps=int(rng.integers(10, 60)))
    used = set(rng.choice(len(snap.steps), int(rng.integers(1, 6)), replace=False).tolist())
    for i, s in enumerate(snap.steps):
        if i in used:
            s.cascade_rows, s.cascade_tokens = int(rng.integers(2, 64)), 2048
            s.kv_bytes_saved = int(rng.integers(1, 1 << 30))
    saved = sum(s.kv_bytes_saved for s in snap.steps) / 2 ** 20
    from views.figures_engine import cpu_batch_figure
    for spec in (F.cuda_graph_figure(snap.steps), cpu_batch_figure(snap.steps)):
        check_step_chart(spec)
        line = spec["panels"][0]["lines"][-1]
        assert line["y"] == [s.cascade_rows for s in snap.steps]
        assert f"{len(used)} steps read a shared prefix once ({saved:,.1f} MiB" in spec["title"]


def test_history_figure_spans_each_bucket_and_reaches_back_to_the_first(rng):
    from views.figures_engine import history_figure
    from views.engine_timeline import Bucket
    now = 10_000.0
    buckets = [Bucket(now - 600 + 10 * k, 10.0, 1, int(rng.integers(0, 99)),
                      int(rng.integers(0, 99)), 0.5, int(rng.integers(0, 5)))
               for k in range(int(rng.integers(1, 40)))]
    spec = history_figure(buckets, now)
    check_step_chart(spec)
    assert spec["x"]["lo"] == [b.t - now for b in buckets]
    assert spec["x"]["hi"] == [b.t + 10 - now for b in buckets]
    assert spec["x"]["range"] == [-600.0, 0]
    pre, dec = spec["panels"][0]["series"]
    assert pre["y"] == pytest.approx([b.prefill_tokens / 10 for b in buckets])
    assert dec["y"] == pytest.approx([b.decode_tokens / 10 for b in buckets])


def test_latency_table_has_p50_p90_p99_in_ms():
    from views.figures_engine import latency_table
    lat = {"requests": 3, "ttft": [0.012, 0.02, 0.5], "tpot": None,
           "e2e": [1.0, 2.0, 3.0]}
    spec = latency_table(lat, 300)
    assert spec["head"] == ["", "p50", "p90", "p99"]
    assert spec["rows"] == [["time to first token (ms)", "12", "20", "500"],
                            ["time per output token (ms)", "—", "—", "—"],
                            ["end to end (ms)", "1000", "2000", "3000"]]
    assert "rows" not in latency_table({"requests": 0}, 300)


def test_tp_map_places_each_head_on_its_rank(rng):
    tp = int(rng.choice([2, 4]))
    snap = make_snapshot(rng, tp=tp, moe=bool(rng.integers(2)))
    fig = F.tp_map_figure(snap.tp_layout, snap.num_heads, snap.num_kv_heads)
    q = [d for d in fig["data"] if d["type"] == "scatter" and d["xaxis"] == "x"]
    kv = [d for d in fig["data"] if d["type"] == "scatter" and d["xaxis"] == "x2"]
    assert [d["x"] for d in q] == [r.q_heads for r in snap.tp_layout]
    assert [d["x"] for d in kv] == [r.kv_heads for r in snap.tp_layout]
    assert [set(d["y"]) for d in q if d["y"]] == [{f"rank {r.rank}"} for r in snap.tp_layout
                                                  if r.q_heads]
    bars = [d for d in fig["data"] if d["type"] == "bar"]
    slices = [r.expert_slice or r.mlp_slice for r in snap.tp_layout]
    assert [(b["base"][0], b["x"][0]) for b in bars] == [(a, b - a) for a, b in slices]
    assert [b["marker"]["color"] for b in bars] == [PALETTE[r.rank] for r in snap.tp_layout]
    assert fig["layout"]["xaxis"]["range"] == [-0.5, snap.num_heads - 0.5]


# ---- every figure and chart --------------------------------------------------------------------

def test_every_plotly_figure_sets_uirevision_text_titles_and_strict_json(rng):
    snap = make_snapshot(rng, moe=True)
    data = rng.normal(size=(4, 8)).astype(np.float32)
    data[1, 2] = np.nan
    figs = [F.kv_usage_figure(snap, [], 1000.0), F.kv_block_figure(data, 1, 0, 0, "v"),
            F.tp_map_figure(snap.tp_layout, 4, 2), F.empty_figure("nothing yet", "t")]
    for fig in figs:
        check_plotly_figure(fig)
        assert fig["layout"]["showlegend"] is False        # legends re-measure on every redraw
        for name, axis in fig["layout"].items():
            if name.startswith(("xaxis", "yaxis")):
                assert axis["ticklabeloverflow"] == "allow", name
        strict_json(plot_value(fig))                       # NaN sent as null


def test_every_layers_chart_is_a_well_formed_spec(rng):
    tr = trace(rng, moe_experts=8)
    step = tr.attention[-1]
    specs = [F.norms_figure(tr), F.logit_lens_figure(tr, decode),
             F.attention_heads_figure(step, 0, tr.token_texts),
             F.attention_row_figure(step, 0, 0, tr.token_texts), F.routing_figure(tr, 0, 8),
             F.expert_load_figure(rng.integers(0, 9, (3, 8))), empty_chart("why", "title")]
    for spec in specs:
        check_chart_spec(spec)
        assert strict_json(chart_value(spec))


def test_chart_value_serialises_a_spec_with_nan_as_null(rng):
    z = rng.normal(size=(3, 5)).astype(np.float32)
    holes = rng.random(z.shape) < 0.4
    holes[0, :2] = True, False                       # at least one hole, one number
    z[holes] = np.nan
    values = [float(v) for v in rng.random(4)]
    values[int(rng.integers(4))] = float("nan")
    spec = {"kind": "heatmap", "z": z, "zmin": np.float32(z[~holes].min()),
            "zmax": np.float64("nan"), "n": np.int64(7), "panels": [{"values": values}],
            "inf": float("inf")}
    out = strict_json(chart_value(spec))
    assert [[v is None for v in row] for row in out["z"]] == holes.tolist()
    assert np.allclose([v for row in out["z"] for v in row if v is not None], z[~holes])
    assert out["zmin"] == pytest.approx(float(z[~holes].min())) and out["zmax"] is None
    assert out["n"] == 7 and out["inf"] is None
    assert out["panels"][0]["values"] == [None if np.isnan(v) else v for v in values]
    assert chart_value(None) is None
    text = chart_value(F.norms_figure(trace(rng)))
    assert chart_value(text) is text                 # a value already serialised passes through
    assert "NaN" not in text and strict_json(text)["kind"] == "heatmap"


def test_plot_value_sends_every_nan_as_null_whatever_the_array(rng):
    """Float arrays, object arrays (text beside numbers) and plain lists: strict JSON out."""
    vals = rng.standard_normal(6)
    vals[[1, 4]] = np.nan
    mixed = np.array(["a", float("nan"), 3.5, None], dtype=object)
    fig = {"data": [{"type": "scatter", "y": vals, "customdata": mixed,
                     "x": [0.0, float("nan"), 2.0]}], "layout": {}}
    out = strict_json(plot_value(fig))["data"][0]
    assert out["y"][1] is None and out["y"][4] is None and out["y"][0] == vals[0]
    assert out["customdata"] == ["a", None, 3.5, None]
    assert out["x"] == [0.0, None, 2.0]


def test_plot_value_reads_the_same_with_orjson_and_with_json(rng, monkeypatch):
    """The fast encoder (orjson, with the playground) and the fallback (json, on a machine
    without it) give the same JSON: NaN/inf as null in arrays and plain floats, numpy scalars,
    float32 values, int keys as text, non-ASCII text, nested tuples."""
    import views.live_plot as LP
    if LP.orjson is None:
        pytest.skip("orjson is not installed here")
    z = rng.standard_normal((3, 4)).astype(np.float32)
    z[1, 2] = np.nan
    fig = {"z": z, "ids": rng.integers(-5, 5, 7), "flags": np.array([True, False]),
           "n": np.int64(7), "p": np.float32(0.25), "inf": float("inf"), "nan": float("nan"),
           "text": "naïve → 漢字 \u2028", 3: "int key", "nested": ({"a": (1, 2.5)}, [None]),
           "mixed": np.array(["a", float("nan"), 1.5], dtype=object)}
    fast = strict_json(LP.plot_value(fig))
    monkeypatch.setattr(LP, "orjson", None)
    slow = strict_json(LP.plot_value(fig))
    assert fast.keys() == slow.keys()
    for k in fast:
        if k == "z":        # float32: orjson writes the shortest float32 text, json the float64
            as32 = lambda v: np.array(v, dtype=float).astype(np.float32)   # noqa: E731
            np.testing.assert_array_equal(as32(fast[k]), as32(slow[k]))
            np.testing.assert_array_equal(as32(fast[k]), z)
        else:
            assert fast[k] == slow[k], k


def test_norms_colour_range_is_never_another_requests_under_the_same_id(rng):
    """A request id can come again (a client's X-Request-Id, a new engine): the range kept for
    the first must not colour the second."""
    first = trace(rng, num_prompt=8)
    F.norms_figure(first)                       # keeps the first's range for ("req-0", 8)
    second = trace(rng, num_prompt=8)
    second.resid_norms = [r * 7.0 + 3.0 for r in second.resid_norms]
    spec = F.norms_figure(second)
    prompt = second.norms()[:8]
    assert spec["zmin"] == pytest.approx(prompt.min())
    assert spec["zmax"] == pytest.approx(np.percentile(prompt, 99))


def test_block_table_cells_are_never_another_requests_under_the_same_id():
    """A reused request id with a table of the same length shows its own block ids."""
    from views.figures_kv import _table_cells
    ref = np.ones(64, np.int32)
    a = _table_cells("reused-id", "#123456", [3, 4, 5], ref)
    b = _table_cells("reused-id", "#123456", [9, 10, 11], ref)
    assert "physical 9" in b and "physical 3" not in b and "physical 3" in a


def test_packed_map_arrays_take_the_narrowest_type_and_round_trip():
    from figure_helpers import unpack_ints
    from views.figures_kv import pack_ints
    rng = np.random.default_rng()
    for lo, hi, tag in ((0, 255, "u1"), (-1, 100, "i1"), (0, 65_535, "u2"), (-1, 30_000, "i2"),
                        (-1, 65_536, "i4"), (0, 2**31 - 1, "i4")):
        a = rng.integers(lo, hi + 1, 500)
        a[:2] = lo, hi                           # the bounds themselves must survive
        m = pack_ints(a)
        assert m["dtype"] == tag and m["n"] == 500
        assert unpack_ints(m).tolist() == a.tolist()
    empty = pack_ints(np.zeros(0, np.int64))
    assert empty["n"] == 0 and unpack_ints(empty).size == 0


def test_tp_map_head_axes_draw_no_zero_line(rng):
    """Heads are counted from 0: plotly's zero line on a head axis struck through head 0's
    marker (the README's Engine screenshot)."""
    snap = make_snapshot(rng)
    layout = F.tp_map_figure(snap.tp_layout, snap.num_heads, snap.num_kv_heads)["layout"]
    assert layout["xaxis"]["zeroline"] is False and layout["xaxis2"]["zeroline"] is False


def test_latency_note_counts_one_request_in_the_singular():
    from views.figures_engine import latency_table
    lat = {"requests": 1, "ttft": [0.01] * 3, "tpot": [0.02] * 3, "e2e": [0.5] * 3}
    assert latency_table(lat, 300)["note"].startswith("1 request finished ")
    assert latency_table(dict(lat, requests=7), 300)["note"].startswith("7 requests finished ")
