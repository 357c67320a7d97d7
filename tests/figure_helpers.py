"""Helpers for the figure tests: fresh random seeds, random KV caches, the block map decoded the
way views/kv_map.js draws it, and checks that a figure or canvas chart spec is well formed."""
from __future__ import annotations

import base64
import json
import os
import re
import secrets
from dataclasses import dataclass

import numpy as np
import pytest

from ui_helpers import make_snapshot  # noqa: I001  (puts the repo on sys.path)

from engine.records import BlockInfo, EngineSnapshot

MAP_STATES = ["free", "evictable", "owned", "shared"]     # views/figures_kv.py STATE_CODE order


def seeded_rng(request) -> np.random.Generator:
    """A generator on a fresh seed each run (GLASSBOX_TEST_SEED=n replays one); the seed is
    printed, so a failure's captured output says how to reproduce it."""
    seed = int(os.environ.get("GLASSBOX_TEST_SEED") or secrets.randbits(32))
    print(f"{request.node.name}: GLASSBOX_TEST_SEED={seed}")
    return np.random.default_rng(seed)


def decode(ids) -> str:
    return " ".join(f"t{i}" for i in ids)


# ---- KV caches -------------------------------------------------------------------------------

def random_cache(rng: np.random.Generator, num_blocks: int, busy: int, block_size: int = 16,
                 num_requests: int = 12, shared_frac: float = 0.25, evictable: int = 0,
                 max_owners: int = 4, ids: np.ndarray | None = None) -> EngineSnapshot:
    """A snapshot whose `busy` live blocks (owned or shared, ids drawn at random over the whole
    cache unless `ids` are given) belong to random running requests, plus `evictable` cached
    free blocks at other random ids; every other block is free.

    The snapshot carries what the engine hands out (per-block arrays, block tables, each
    request's computed tokens) and, as `snap.blocks`, the ground truth drawn here (owners in
    block-table order, fills, hashes, token ids), so builders that derive per-block facts from
    the arrays are checked against an independent answer."""
    snap = make_snapshot(rng, num_blocks=num_blocks, block_size=block_size)
    rids = [f"req-{i}" for i in rng.permutation(64)[:num_requests]]
    chosen = rng.permutation(num_blocks)[:busy + evictable] if ids is None else np.asarray(ids)
    live, cached = sorted(chosen[:busy].tolist()), chosen[busy:].tolist()
    # drawn in bulk: a 40,000-block cache takes a fraction of a second
    shared = (rng.random(len(live)) < shared_frac).tolist()
    top = max(3, min(max_owners, num_requests) + 1)
    num_owners = rng.integers(2, top, len(live)).tolist()
    one_owner = rng.integers(0, num_requests, len(live)).tolist()
    last_fill = rng.integers(1, block_size + 1, num_requests).tolist()
    hashes = rng.integers(1 << 62, size=len(live) + len(cached)).tolist()
    toks = rng.integers(0, 150_000, (len(live) + len(cached), block_size)).tolist()
    owners_of: dict[int, list[int]] = {}
    tables: dict[str, list[int]] = {r: [] for r in rids}
    for j, bid in enumerate(live):
        ks = (sorted(rng.choice(num_requests, num_owners[j], replace=False).tolist())
              if shared[j] else [one_owner[j]])
        owners_of[bid] = ks
        for k in ks:
            tables[rids[k]].append(bid)
    ref = np.zeros(num_blocks, np.int32)
    hashed = np.zeros(num_blocks, np.bool_)
    fill = {}
    tokens = {}
    for k, r in enumerate(rids):
        t = tables[r]
        if not t:
            continue
        # a request's last block may be partly written, unless another request shares it
        f = block_size if len(owners_of[t[-1]]) > 1 else last_fill[k]
        tokens[r] = block_size * (len(t) - 1) + f
        for j, bid in enumerate(t):
            fill[bid] = max(fill.get(bid, 0), block_size if j < len(t) - 1 else f)
    blocks = [BlockInfo(i, 0, [], 0, None, False, []) for i in range(num_blocks)]
    for j, bid in enumerate(live):
        ks = owners_of[bid]
        ref[bid] = len(ks)
        h = hashes[j] if len(ks) > 1 else None          # a shared block is a cached prefix
        hashed[bid] = h is not None
        blocks[bid] = BlockInfo(bid, len(ks), [rids[k] for k in ks], fill[bid], h, False,
                                toks[j][:fill[bid]])
    for j, bid in enumerate(cached, start=len(live)):
        hashed[bid] = True
        blocks[bid] = BlockInfo(bid, 0, [], block_size, hashes[j], True, toks[j])
    snap.block_ref, snap.block_hashed = ref, hashed
    snap.block_tables = {r: t for r, t in tables.items() if t}
    snap.request_tokens = tokens
    snap.blocks = blocks                                 # the truth (overrides the derived)
    snap.running = list(snap.block_tables)
    snap.num_free_blocks = num_blocks - busy
    snap.usage = busy / num_blocks
    return snap


def live_ids(snap: EngineSnapshot) -> set[int]:
    return {b.block_id for b in snap.blocks if b.ref_count > 0}


@dataclass
class MapCell:
    state: str
    fill: int
    ref: int
    owners: list[str]
    colour: str


def unpack_map(value: str) -> dict:
    """The map's value as the page reads it (views/kv_map.js): packed arrays unpacked."""
    import base64
    payload = strict_json(value)
    for key, a in payload.items():
        if isinstance(a, dict) and "b64" in a:
            payload[key] = np.frombuffer(base64.b64decode(a["b64"]),
                                         "<" + a.get("dtype", "i4"))[:a["n"]].tolist()
    return payload


def drawn_ids(payload: dict) -> list[int]:
    """The block ids the canvas draws, in drawing order (views/kv_map.js: ids 0..shown-1, or the
    listed ids when `shown` is null)."""
    return list(range(payload["shown"])) if payload["shown"] is not None else list(payload["ids"])


def map_cells(payload: dict) -> dict[int, MapCell]:
    """Every drawn cell with its state, fill, ref count, owners and colour, read from the map's
    payload the way views/kv_map.js reads it (an unlisted id is a free block)."""
    index = {bid: i for i, bid in enumerate(payload["ids"])}
    assert len(index) == len(payload["ids"]), "a block listed twice"
    cells = {}
    for bid in drawn_ids(payload):
        i = index.get(bid)
        if i is None:
            cells[bid] = MapCell("free", 0, 0, [], payload["colour_free"])
            continue
        state = MAP_STATES[payload["state"][i]]
        own = payload["owner"][i]
        idx = payload["more_owners"].get(str(bid), [own] if own >= 0 else [])
        owners = [payload["owners"][k] for k in idx]
        colour = (payload["colour_evictable"] if state == "evictable" else
                  payload["colours"][own] if own >= 0 else "#495057")
        cells[bid] = MapCell(state, payload["fill"][i], payload["ref"][i], owners, colour)
    return cells


# ---- figures and specs -------------------------------------------------------------------------

def strict_json(text: str):
    """Parse as JSON.parse would: NaN / Infinity are not JSON."""
    def bad(name):
        raise ValueError(f"{name} in JSON")
    return json.loads(text, parse_constant=bad)


def walk(obj, path=""):
    """Every (path, key, value) in a nested dict / list."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield path, k, v
            yield from walk(v, f"{path}.{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from walk(v, f"{path}[{i}]")


def check_plotly_figure(fig: dict) -> None:
    """A plotly figure dict plotly.js 3+ draws as meant: uirevision set, every title given as
    {"text": ...} (a bare string is ignored), traces with a type."""
    assert set(fig) == {"data", "layout"}, set(fig)
    assert fig["layout"].get("uirevision"), "no uirevision: live updates would reset the zoom"
    for path, key, value in walk(fig):
        if key == "title":
            assert isinstance(value, dict) and "text" in value, f"{path}.title = {value!r}"
    assert all(isinstance(t, dict) and t.get("type") for t in fig["data"])


COLOUR = re.compile(r"^(#[0-9a-fA-F]{6}|rgba?\([\d.,\s]+\))$")


def _shape(a) -> tuple[int, ...]:
    return np.asarray(a, dtype=object).shape


def check_chart_spec(spec: dict) -> None:
    """A canvas chart spec views/canvas_chart.js can draw: the fields it reads are there and
    agree in size, colours parse, marks fall on the grid (an empty chart has a message)."""
    assert spec.get("title") is not None and spec.get("height", 1) > 0
    if "message" in spec:
        assert "kind" not in spec and spec["message"]
        return
    if spec["kind"] == "bars":
        panels = spec["panels"]
        assert sum(p["width"] for p in panels) == pytest.approx(1.0)
        for p in panels:
            n = len(p["values"])
            assert COLOUR.match(p["colour"])
            for key in ("labels", "tick_labels", "hover"):
                assert p[key] is None or len(p[key]) == n, key
            assert p["ymax"] >= float(np.max(p["values"], initial=0))
        return
    assert spec["kind"] == "heatmap"
    z = np.asarray(spec["z"], dtype=float)
    rows, cols = z.shape
    assert len(spec["y_labels"]) == rows
    assert spec["zmax"] > spec["zmin"]
    span = max(cols, spec.get("x_end") or cols)
    assert spec.get("x_end") is None or spec["x_end"] >= cols
    for key in ("x_labels", "x_values", "col_text"):
        if spec.get(key) is not None:
            assert len(spec[key]) == cols, key
    for key in ("cell_text", "cell_hover"):
        if spec.get(key) is not None:
            assert _shape(spec[key]) == (rows, cols), key
    stops = spec["colorscale"]
    assert stops[0][0] == 0 and stops[-1][0] == 1
    assert all(a[0] < b[0] for a, b in zip(stops, stops[1:]))
    assert all(COLOUR.match(c) for _, c in stops)
    for r, c in spec.get("markers", []):
        assert 0 <= r < rows and 0 <= c < span, f"marker ({r}, {c}) off the {rows}×{span} grid"
    for m in spec.get("col_outlines", []) + spec.get("spans", []):
        assert 0 <= m["from"] < m["to"] <= span
    for m in spec.get("row_outlines", []):
        assert 0 <= m["from"] < m["to"] <= rows
    for m in spec.get("vlines", []):
        assert 0 <= m["at"] <= span
    if spec.get("colorbar"):
        for v, label in spec["colorbar"]["ticks"]:
            assert spec["zmin"] - 1e-9 <= v <= spec["zmax"] + 1e-9 and label


def kv_map_lists(payload: dict) -> dict:
    """The KV map's payload with its arrays as plain lists (what the page ends up with)."""
    return {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in payload.items()}


def unpack_ints(m: dict) -> np.ndarray:
    """views/figures_kv.pack_ints' inverse: what views/kv_map.js does in the page."""
    return np.frombuffer(base64.b64decode(m["b64"]), "<" + m.get("dtype", "i4"))[:m["n"]]

