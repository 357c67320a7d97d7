"""Pure builders for the KV-cache tab: block grid, block tables, usage history, layout, drilldown."""
from __future__ import annotations

import html
from typing import Callable, Sequence

import numpy as np
import plotly.graph_objects as go

from engine.probes.snapshot import EngineSnapshot, KVLayout
from views.figures_common import (EVICTABLE_COLOUR, FREE_COLOUR, make_figure, request_colour,
                                  short_text)

Decode = Callable[[Sequence[int]], str]
MAX_GRID_CELLS = 4096     # a GPU cache can hold 100k blocks; past this we show used ones first
MAX_TABLE_ROWS = 24
MAX_TABLE_CELLS = 96
HATCH = "repeating-linear-gradient(45deg,transparent 0 3px,rgba(255,255,255,.75) 3px 5px),"


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def block_state(block) -> str:
    """'free', 'evictable', 'shared' or 'owned' — the grid's legend classes."""
    if block.ref_count == 0:
        return "evictable" if block.evictable else "free"
    return "shared" if block.ref_count > 1 else "owned"


def _cell(block, block_size: int, decode: Decode) -> str:
    state = block_state(block)
    fill = 100.0 * block.num_filled / block_size if block_size else 0.0
    if state in ("owned", "shared"):
        colour = request_colour(block.owners[0]) if block.owners else "#495057"
    elif state == "evictable":
        colour = EVICTABLE_COLOUR
    else:
        colour = FREE_COLOUR
    # shade = fill: the cell fills from the bottom like a glass
    style = (f"background:{HATCH if state == 'evictable' else ''}linear-gradient(to top,"
             f"{colour} {fill:.0f}%,{FREE_COLOUR} {fill:.0f}%);border-color:{colour}")
    text = decode(block.token_ids) if block.token_ids else ""
    owners = ", ".join(block.owners) if block.owners else "—"
    tip = (f"block {block.block_id} · {state} · ref {block.ref_count}\n"
           f"owners: {owners}\nfilled {block.num_filled}/{block_size}"
           + (f" · hash {block.prefix_hash & 0xffffffff:08x}" if block.prefix_hash is not None
              else "")
           + (f"\n“{text}”" if text else ""))
    return (f'<div class="kv-cell kv-{state}" data-block="{block.block_id}" '
            f'data-owners="{html.escape(",".join(block.owners), quote=True)}" '
            f'data-tip="{html.escape(tip, quote=True)}" style="{style}"></div>')


def kv_grid_html(snap: EngineSnapshot, decode: Decode) -> str:
    """Every physical block as a cell: colour = owner, fill = shade, marks for shared/evictable."""
    by_id = {b.block_id: b for b in snap.blocks}
    if snap.num_blocks <= MAX_GRID_CELLS:
        ids = list(range(snap.num_blocks))
    else:   # used and cached blocks first, then free ones up to the cap
        busy = sorted(i for i, b in by_id.items() if b.ref_count or b.evictable)
        busy_set = set(busy)
        rest = [i for i in range(snap.num_blocks) if i not in busy_set]
        ids = sorted(busy[:MAX_GRID_CELLS] + rest[: max(0, MAX_GRID_CELLS - len(busy))])
    cells = []
    for i in ids:
        b = by_id.get(i)
        if b is None:   # the engine may omit never-touched blocks: they are free and empty
            cells.append(f'<div class="kv-cell kv-free" data-block="{i}" '
                         f'data-tip="block {i} · free"></div>')
        else:
            cells.append(_cell(b, snap.block_size, decode))
    counts = {s: 0 for s in ("owned", "shared", "evictable", "free")}
    for i in range(snap.num_blocks):
        b = by_id.get(i)
        counts[block_state(b) if b else "free"] += 1
    note = (f'<div class="kv-note">showing {len(ids)} of {snap.num_blocks} blocks</div>'
            if len(ids) < snap.num_blocks else "")
    legend = (
        '<div class="kv-legend">'
        f'<span><i class="kv-cell kv-owned" style="background:#1f77b4"></i>owned {counts["owned"]}</span>'
        f'<span><i class="kv-cell kv-shared" style="background:#1f77b4"></i>shared (ref&gt;1) {counts["shared"]}</span>'
        f'<span><i class="kv-cell kv-evictable" style="background:{EVICTABLE_COLOUR}"></i>'
        f'cached, free (evictable) {counts["evictable"]}</span>'
        f'<span><i class="kv-cell kv-free"></i>free {counts["free"]}</span>'
        f'<span class="kv-legend-fill">fill shade = slots written / {snap.block_size}</span>'
        '</div>')
    return (f'<div class="kv-wrap">{legend}<div class="kv-grid" '
            f'data-num-blocks="{snap.num_blocks}">{"".join(cells)}</div>{note}</div>')


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
                    now: float, window_s: float = 60.0) -> go.Figure:
    """KV usage per step and cumulative prefix-hit rate, over the last `window_s` seconds."""
    steps = [s for s in snap.steps if now - s.wall_time <= window_s]
    hits = [(t, r) for t, r in hit_history if now - t <= window_s]
    traces = [
        go.Scatter(x=[s.wall_time - now for s in steps], y=[s.kv_usage for s in steps],
                   mode="lines", name="KV usage", line=dict(color="#4e79a7", width=2, shape="hv"),
                   customdata=[s.step_id for s in steps],
                   hovertemplate="step %{customdata}<br>usage %{y:.0%}<extra></extra>"),
        go.Scatter(x=[t - now for t, _ in hits], y=[r for _, r in hits], mode="lines",
                   name="prefix-hit rate", line=dict(color="#59a14f", width=2, dash="dot"),
                   hovertemplate="hit rate %{y:.0%}<extra></extra>"),
    ]
    return make_figure(
        traces, f"KV usage {snap.usage:.0%} · prefix hits {snap.prefix_hits}/"
                f"{snap.prefix_queries} ({snap.prefix_hit_rate:.0%})",
        uirevision="kv-usage", height=260,
        legend=dict(orientation="h", y=1.02, x=1, xanchor="right", yanchor="bottom"),
        xaxis=dict(title="seconds ago", range=[-window_s, 0], zeroline=False, gridcolor="#eee"),
        yaxis=dict(range=[0, 1.02], tickformat=".0%", gridcolor="#eee"))


def kv_layout_markdown(layout: KVLayout, block_size: int) -> str:
    """The physical layout as a short markdown table."""
    names = ["K/V", "layers", "blocks", "block_size", "kv_heads", "head_dim"]
    dims = " × ".join(f"{n}={d}" for n, d in zip(names, layout.shape)) \
        if len(layout.shape) == len(names) else " × ".join(map(str, layout.shape))
    return (f"**Physical KV cache** `{list(layout.shape)}` ({dims}), `{layout.dtype}`\n\n"
            f"| per token | per block ({block_size} tokens) | total |\n|---|---|---|\n"
            f"| {_fmt_bytes(layout.bytes_per_token)} | {_fmt_bytes(layout.bytes_per_block)} | "
            f"{_fmt_bytes(layout.total_bytes)} |")


def kv_block_figure(data: np.ndarray, block_id: int, layer: int, head: int, which: str,
                    token_texts: Sequence[str] = ()) -> go.Figure:
    """One block's K or V for one layer and head: slot × head_dim, symmetric colour range."""
    data = np.asarray(data, dtype=np.float32)   # [block_size, head_dim]
    vmax = float(np.nanmax(np.abs(data))) if data.size else 1.0
    labels = [f"{i}: {short_text(token_texts[i])}" if i < len(token_texts) else f"{i}: (empty)"
              for i in range(data.shape[0])]
    heat = go.Heatmap(z=data, y=labels, x=list(range(data.shape[1])), colorscale="RdBu",
                      zmid=0, zmin=-vmax or -1, zmax=vmax or 1, colorbar=dict(title=which.upper()),
                      hovertemplate="slot %{y}<br>dim %{x}<br>%{z:.4f}<extra></extra>")
    return make_figure(
        [heat], f"{which.upper()} of block {block_id}, layer {layer}, kv head {head}",
        uirevision=f"kv-block-{data.shape}", height=max(260, 18 * data.shape[0] + 90),
        xaxis=dict(title="head dim"),
        yaxis=dict(title="slot: token", autorange="reversed", type="category"))
