"""Pure builders for the KV-cache tab: block grid, block tables, usage history, layout, drilldown."""
from __future__ import annotations

import base64
import html
import itertools
from collections import OrderedDict
from typing import Callable, Sequence

import numpy as np

from engine.records import EngineSnapshot, KVLayout
from views.live_plot import plot_value
from views.figures_common import (EVICTABLE_COLOUR, FREE_COLOUR, Figure, fmt_bytes, heatmap,
                                  legend_title, make_figure, plotly_text, request_colour, scatter,
                                  short_text)

Decode = Callable[[Sequence[int]], str]
MAX_MAP_CELLS = 16384     # a GPU cache can hold 100k blocks; past this only busy ones are drawn
MAP_ROW = 32              # the drawn region grows a row of this many blocks at a time
MAP_MIN_CELLS = 256       # ... and is never smaller than this
MAX_TABLE_ROWS = 24
MAX_TABLE_CELLS = 96


def block_state(block) -> str:
    """'free', 'evictable', 'shared' or 'owned' — the grid's legend classes."""
    if block.ref_count == 0:
        return "evictable" if block.evictable else "free"
    return "shared" if block.ref_count > 1 else "owned"


STATE_CODE = {"free": 0, "evictable": 1, "owned": 2, "shared": 3}


def block_states(snap: EngineSnapshot) -> np.ndarray:
    """[num_blocks] STATE_CODE of every block, from the snapshot's arrays."""
    # shared 3, owned 2, else evictable (hashed) 1 or free 0: int8 arithmetic on whole arrays
    # (np.select cost ~2 ms a tick at 65k blocks, np.where 0.15 ms, this 0.03 ms)
    held = np.minimum(snap.block_ref, 2).astype(np.int8)
    state = held + (held > 0)
    state |= snap.block_hashed & (held == 0)
    return state


def _map_region(num_blocks: int, highest_busy: int) -> int:
    """How many blocks (ids 0..n-1) the map draws: the region in use, rounded up to a row of
    MAP_ROW cells, at least MAP_MIN_CELLS; the whole cache when it is small."""
    if num_blocks <= MAP_MIN_CELLS:
        return num_blocks
    n = -(-(highest_busy + 1) // MAP_ROW) * MAP_ROW
    return min(num_blocks, max(MAP_MIN_CELLS, n))


def kv_map_data(snap: EngineSnapshot, version: int = 0) -> dict:
    """The block map as compact JSON for the canvas in views/kv_map.js.

    Only non-free blocks are listed (free ones are implied), in parallel arrays: id, state code
    (STATE_CODE), fill (slots written), ref count, owner index into `owners` (whose colours are
    in `colours`); `more_owners` lists every owner of a shared block. The canvas draws ids
    0..`shown`-1, the region in use; past MAX_MAP_CELLS it draws the listed blocks only (in id
    order, `shown` None). Owned and shared blocks are never left out, whatever the number of
    cached-free ones. Built with numpy from the snapshot's arrays: ~1 ms for 100k blocks.
    """
    a = snap.kv_arrays
    state = block_states(snap)
    # bool masks and count_nonzero: bincount and nonzero over int8 cost 0.1-0.25 ms each
    listed = np.flatnonzero((snap.block_ref > 0) | snap.block_hashed)   # non-free, in id order
    counts = {name: int(np.count_nonzero(state == code)) for name, code in STATE_CODE.items()
              if code}
    counts = {"free": snap.num_blocks - len(listed), **counts}
    highest = int(listed[-1]) if len(listed) else -1
    if len(listed) > MAX_MAP_CELLS:   # a huge GPU cache: every live block, then cached ones
        live = listed[state[listed] >= STATE_CODE["owned"]]
        cached = listed[state[listed] < STATE_CODE["owned"]]
        listed = np.sort(np.concatenate([live, cached[:max(0, MAX_MAP_CELLS - len(live))]]))
    if len(listed) < snap.num_blocks:           # a mask lookup, not np.isin's sort
        is_listed = np.zeros(snap.num_blocks, bool)
        is_listed[listed] = True
        keep = is_listed[a.shared_blocks]
    else:
        keep = np.ones(len(a.shared_blocks), bool)
    sb, so = a.shared_blocks[keep], a.shared_owners[keep]
    # owners with a listed block, renumbered in order of request (table order)
    own = a.owner[listed]
    seen = np.zeros(len(a.owners) + 1, bool)    # the last slot takes the -1s (no owner)
    seen[own] = True
    seen[so] = True
    used = np.flatnonzero(seen[:-1])
    remap = np.full(len(a.owners) + 1, -1, np.int64)   # the extra last slot maps -1 to -1
    remap[used] = np.arange(len(used))
    own, so = remap[own], remap[so]
    more: dict[str, list[int]] = {}
    if len(sb):
        cuts = np.flatnonzero(np.diff(sb)) + 1
        for b, group in zip(sb[np.r_[0, cuts]].tolist(), np.split(so, cuts)):
            more[str(b)] = group.tolist()
    names = [a.owners[i] for i in used.tolist()]
    shown = _map_region(snap.num_blocks, highest)
    running = set(snap.running)
    return {"version": version, "num_blocks": snap.num_blocks, "block_size": snap.block_size,
            "shown": shown if shown <= MAX_MAP_CELLS else None,
            "ids": listed, "state": state[listed], "fill": a.filled[listed],
            "ref": snap.block_ref[listed], "owner": own, "more_owners": more, "owners": names,
            "colours": [request_colour(r) for r in names],
            "running": [r in running for r in names], "counts": counts,
            "colour_free": FREE_COLOUR, "colour_evictable": EVICTABLE_COLOUR}


PACKED_KEYS = ("ids", "state", "fill", "ref", "owner")
# the narrowest little-endian type that holds an array's values (views/kv_map.js reads the tag)
_PACK_TYPES = (("u1", 0, 0xFF), ("i1", -0x80, 0x7F), ("u2", 0, 0xFFFF), ("i2", -0x8000, 0x7FFF),
               ("i4", -0x80000000, 0x7FFFFFFF))


def pack_ints(values) -> dict:
    """An integer array as {"b64", "n", "dtype"}: base64 of its values in the narrowest type of
    _PACK_TYPES (state codes, fills and ref counts fit a byte; ids and owners rarely need four)."""
    a = np.asarray(values)
    lo, hi = (int(a.min()), int(a.max())) if a.size else (0, 0)
    tag = next(t for t, low, high in _PACK_TYPES if low <= lo and hi <= high)
    b = np.ascontiguousarray(a, dtype="<" + tag)
    return {"b64": base64.b64encode(b.tobytes()).decode("ascii"), "n": int(a.size), "dtype": tag}


def kv_map_json(payload: dict) -> str:
    """The map's payload as the string the page gets: its parallel arrays packed as base64 in
    their narrowest integer type (views/kv_map.js unpacks them). A busy 65k-block cache lists
    ~16k blocks: as JSON numbers that is ~50 ms of the server's Python (and of the GIL the
    engine's thread needs); packed as int32 ~1 ms, narrowed about half of that (the string is
    ~45 % of the int32 one, and the encoder scans every character of it)."""
    out = dict(payload)
    for key in PACKED_KEYS:
        out[key] = pack_ints(payload[key])
    return plot_value(out)


def block_detail(info, block_size: int, decode: Decode) -> str:
    """One block described for the map's hover card: state, ref count, owners, fill, the
    prefix hash and the text it holds. `info` is `LLM.block_info(id)`: read on demand."""
    b = info
    if b.ref_count == 0 and not b.evictable:
        return f"block {b.block_id} · free"
    owners = ", ".join(b.owners) if b.owners else "—"
    text = decode(b.token_ids) if b.token_ids else ""
    return (f"block {b.block_id} · {block_state(b)} · ref {b.ref_count}\n"
            f"owners: {owners}\nfilled {b.num_filled}/{block_size}"
            + (f" · hash {b.prefix_hash & 0xffffffff:08x}" if b.prefix_hash is not None else "")
            + (f"\n“{text}”" if text else "")
            + ("\ntext hidden: a private request's block (sent with a cache_salt)"
               if b.hidden else ""))


def request_meta_html(rec) -> str:
    """A request's sampling choices, its grammar's state and the API's note (tool calls) under
    its block-table row; "" for a request the snapshot has no record of."""
    if rec is None:
        return ""
    parts = [f'<span class="kv-tsampling" title="sampling">{html.escape(rec.sampling)}</span>']
    if rec.guided:
        mask = "" if rec.allowed is None else \
            f" · last mask {rec.vocab - rec.allowed:,} of {rec.vocab:,} tokens masked"
        parts.append(f'<span class="kv-tgrammar">grammar: {rec.masked_steps} masked steps'
                     f'{mask}</span>')
    if rec.note:
        parts.append(f'<span class="kv-tnote">{html.escape(rec.note)}</span>')
    return f'<div class="kv-treq">{" · ".join(parts)}</div>'


_CELLS: OrderedDict[tuple, str] = OrderedDict()


def _table_cells(rid: str, colour: str, table: list[int], ref: np.ndarray) -> str:
    """One request's table cells as HTML, made once per (table, which cells are shared): a
    live tab redraws every table several times a second. The key holds the ids themselves (one
    numpy pass, as the sharing test needs anyway): a request id can come again — a client's
    X-Request-Id — with other blocks."""
    ids = np.asarray(table, dtype=np.int64)
    shared = (ref[ids] > 1) if table else np.zeros(0, bool)
    key = (rid, colour, ids.tobytes(), shared.tobytes())
    html_cells = _CELLS.get(key)
    if html_cells is None:
        html_cells = "".join(
            f'<span class="kv-tcell{" kv-tshared" if sh else ""}" '
            f'style="border-color:{colour}" title="logical {j} → physical {b}">{b}</span>'
            for j, (b, sh) in enumerate(zip(table, shared.tolist())))
        _CELLS[key] = html_cells
        while len(_CELLS) > 512:
            _CELLS.popitem(last=False)
    return html_cells


def block_tables_html(snap: EngineSnapshot) -> str:
    """Each request's block table as a row of physical block ids, coloured like the grid."""
    if not snap.block_tables:
        return '<div class="kv-tables kv-empty">No request holds blocks right now.</div>'
    ref = snap.block_ref
    rows = []
    running, waiting = set(snap.running), set(snap.waiting)
    # the first rows only: each table read is a slice (records.TableViews), 256 of them 0.2 ms
    for rid, table in itertools.islice(snap.block_tables.items(), MAX_TABLE_ROWS):
        colour = request_colour(rid)
        status = ("running" if rid in running else "waiting" if rid in waiting else "")
        cells = _table_cells(rid, colour, table[:MAX_TABLE_CELLS], ref)
        more = f'<span class="kv-more">+{len(table) - MAX_TABLE_CELLS}</span>' \
            if len(table) > MAX_TABLE_CELLS else ""
        ntok = snap.request_tokens.get(rid, 0)
        req = request_meta_html(snap.requests.get(rid))
        rows.append(
            f'<div class="kv-trow" data-request="{html.escape(rid, quote=True)}">'
            f'<span class="kv-rid" style="background:{colour}">{html.escape(rid)}</span>'
            f'<span class="kv-tmeta">{ntok} tok · {len(table)} blk {status}</span>{cells}{more}'
            f'{req}</div>')
    extra = len(snap.block_tables) - MAX_TABLE_ROWS
    tail = f'<div class="kv-note">+{extra} more requests</div>' if extra > 0 else ""
    head = ('<div class="kv-thead">Block tables: each request\'s blocks in order, as '
            '<b>physical block ids</b> (the cells of the map above; a shared id is the same '
            'block in two tables)</div>')
    return f'<div class="kv-tables">{head}{"".join(rows)}{tail}</div>'


def kv_usage_figure(snap: EngineSnapshot, hit_history: Sequence[tuple[float, float]],
                    now: float, window_s: float = 60.0) -> Figure:
    """KV usage per step and cumulative prefix-hit rate, over the last `window_s` seconds."""
    steps = [s for s in snap.steps if now - s.wall_time <= window_s]
    hits = [(t, r) for t, r in hit_history if now - t <= window_s]
    traces = [
        scatter(x=[s.wall_time - now for s in steps], y=[s.kv_usage for s in steps],
                   mode="lines", name="KV usage", line=dict(color="#4e79a7", width=2, shape="hv"),
                   customdata=[s.step_id for s in steps],
                   hovertemplate="step %{customdata}<br>usage %{y:.0%}<extra></extra>"),
        scatter(x=[t - now for t, _ in hits], y=[r for _, r in hits], mode="lines",
                   name="prefix-hit rate", line=dict(color="#59a14f", width=2, dash="dot"),
                   hovertemplate="hit rate %{y:.0%}<extra></extra>"),
    ]
    return make_figure(
        traces, legend_title(f"KV usage {snap.usage:.0%} · prefix hits {snap.prefix_hits}/"
                             f"{snap.prefix_queries} ({snap.prefix_hit_rate:.0%})",
                             {"KV usage": "#4e79a7", "prefix-hit rate (dotted)": "#59a14f"}),
        uirevision="kv-usage", height=270, margin=dict(l=60, r=20, t=62, b=40),
        xaxis=dict(title="seconds ago", range=[-window_s, 0], zeroline=False, gridcolor="#eee"),
        yaxis=dict(range=[0, 1.02], tickformat=".0%", gridcolor="#eee"))


def kv_layout_markdown(layout: KVLayout, block_size: int) -> str:
    """The physical layout as a short markdown table."""
    names = ["K/V", "layers", "blocks", "block_size", "kv_heads", "head_dim"]
    dims = " × ".join(f"{n}={d}" for n, d in zip(names, layout.shape)) \
        if len(layout.shape) == len(names) else " × ".join(map(str, layout.shape))
    return (f"**Physical KV cache** `{list(layout.shape)}` ({dims}), `{layout.dtype}`\n\n"
            f"| per token | per block ({block_size} tokens) | total |\n|---|---|---|\n"
            f"| {fmt_bytes(layout.bytes_per_token)} | {fmt_bytes(layout.bytes_per_block)} | "
            f"{fmt_bytes(layout.total_bytes)} |")


def kv_block_figure(data: np.ndarray, block_id: int, layer: int, head: int, which: str,
                    token_texts: Sequence[str] = ()) -> Figure:
    """One block's K or V for one layer and head: slot × head_dim, symmetric colour range."""
    data = np.asarray(data, dtype=np.float32)   # [block_size, head_dim]
    vmax = float(np.nanmax(np.abs(data))) if data.size else 1.0
    labels = [f"{i}: {plotly_text(short_text(token_texts[i]))}" if i < len(token_texts)
              else f"{i}: (empty)"
              for i in range(data.shape[0])]
    heat = heatmap(z=data, y=labels, x=list(range(data.shape[1])), colorscale="RdBu",
                      zmid=0, zmin=-vmax or -1, zmax=vmax or 1, colorbar=dict(title=which.upper()),
                      hovertemplate="slot %{y}<br>dim %{x}<br>%{z:.4f}<extra></extra>")
    return make_figure(
        [heat], f"{which.upper()} of block {block_id}, layer {layer}, kv head {head}",
        uirevision=f"kv-block-{data.shape}", height=max(260, 18 * data.shape[0] + 90),
        xaxis=dict(title="head dim"),
        # automargin: the slot labels ("3: <|im_end|>") are never cut at the left edge (this
        # figure is drawn once per click, so plotly's label measuring costs nothing live)
        yaxis=dict(title="slot: token", autorange="reversed", type="category",
                   automargin=True))
