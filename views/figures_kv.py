"""Pure builders for the KV-cache tab: block grid, block tables, usage history, layout, drilldown."""
from __future__ import annotations

import html
from typing import Callable, Sequence

import numpy as np

from engine.probes.snapshot import EngineSnapshot, KVLayout
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
    cached-free ones.
    """
    owners: dict[str, int] = {}
    ids, state, fill, ref, own, more = [], [], [], [], [], {}
    counts = dict.fromkeys(STATE_CODE, 0)
    highest = -1
    for b in snap.blocks:
        st = block_state(b)
        counts[st] += 1
        if st == "free":
            continue
        ids.append(b.block_id)
        state.append(STATE_CODE[st])
        fill.append(b.num_filled)
        ref.append(b.ref_count)
        idx = [owners.setdefault(r, len(owners)) for r in b.owners]
        own.append(idx[0] if idx else -1)
        if len(idx) > 1:
            more[str(b.block_id)] = idx
        highest = max(highest, b.block_id)
    counts["free"] += snap.num_blocks - len(snap.blocks)   # blocks the engine did not list
    live = [i for i, s in enumerate(state) if s >= STATE_CODE["owned"]]
    if len(ids) > MAX_MAP_CELLS:   # a huge GPU cache: every live block, then cached ones
        keep = sorted(live + [i for i, s in enumerate(state)
                              if s < STATE_CODE["owned"]][: max(0, MAX_MAP_CELLS - len(live))])
        ids, state, fill, ref, own = ([a[i] for i in keep] for a in (ids, state, fill, ref, own))
        kept = set(ids)
        more = {k: v for k, v in more.items() if int(k) in kept}
    shown = _map_region(snap.num_blocks, highest)
    running = set(snap.running)
    names = list(owners)
    return {"version": version, "num_blocks": snap.num_blocks, "block_size": snap.block_size,
            "shown": shown if shown <= MAX_MAP_CELLS else None,
            "ids": ids, "state": state, "fill": fill, "ref": ref, "owner": own,
            "more_owners": more, "owners": names,
            "colours": [request_colour(r) for r in names],
            "running": [r in running for r in names], "counts": counts,
            "colour_free": FREE_COLOUR, "colour_evictable": EVICTABLE_COLOUR}


def block_detail(snap: EngineSnapshot, block_id: int, decode: Decode) -> str:
    """One block described for the map's hover card: state, ref count, owners, fill, the
    prefix hash and the text it holds."""
    b = next((x for x in snap.blocks if x.block_id == block_id), None)
    if b is None:
        return f"block {block_id} · free"
    owners = ", ".join(b.owners) if b.owners else "—"
    text = decode(b.token_ids) if b.token_ids else ""
    return (f"block {b.block_id} · {block_state(b)} · ref {b.ref_count}\n"
            f"owners: {owners}\nfilled {b.num_filled}/{snap.block_size}"
            + (f" · hash {b.prefix_hash & 0xffffffff:08x}" if b.prefix_hash is not None else "")
            + (f"\n“{text}”" if text else ""))


def block_tables_html(snap: EngineSnapshot) -> str:
    """Each request's block table as a row of physical block ids, coloured like the grid."""
    if not snap.block_tables:
        return '<div class="kv-tables kv-empty">No request holds blocks right now.</div>'
    ref = {b.block_id: b.ref_count for b in snap.blocks}
    rows = []
    for rid, table in list(snap.block_tables.items())[:MAX_TABLE_ROWS]:
        colour = request_colour(rid)
        status = ("running" if rid in snap.running else
                  "waiting" if rid in snap.waiting else "")
        cells = "".join(
            f'<span class="kv-tcell{" kv-tshared" if ref.get(b, 1) > 1 else ""}" '
            f'style="border-color:{colour}" title="logical {j} → physical {b}">{b}</span>'
            for j, b in enumerate(table[:MAX_TABLE_CELLS]))
        more = f'<span class="kv-more">+{len(table) - MAX_TABLE_CELLS}</span>' \
            if len(table) > MAX_TABLE_CELLS else ""
        ntok = snap.request_tokens.get(rid, 0)
        rows.append(
            f'<div class="kv-trow" data-request="{html.escape(rid, quote=True)}">'
            f'<span class="kv-rid" style="background:{colour}">{html.escape(rid)}</span>'
            f'<span class="kv-tmeta">{ntok} tok · {len(table)} blk {status}</span>{cells}{more}'
            '</div>')
    extra = len(snap.block_tables) - MAX_TABLE_ROWS
    tail = f'<div class="kv-note">+{extra} more requests</div>' if extra > 0 else ""
    return f'<div class="kv-tables">{"".join(rows)}{tail}</div>'


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
