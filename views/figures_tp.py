"""Pure builder of the TP map (Engine and Anatomy tabs): which rank holds which heads and slices.
A plotly figure: it changes only with the model, so it is drawn once, not per tick."""
from __future__ import annotations

from typing import Sequence

from engine.records import RankLayout
from views.figures_common import PALETTE, Figure, bar, empty_figure, fmt_bytes, make_figure, scatter


def tp_map_figure(tp_layout: Sequence[RankLayout], num_heads: int, num_kv_heads: int
                  ) -> Figure:
    """Which rank holds which query heads, KV heads and MLP/expert slice."""
    if not tp_layout:
        return empty_figure("No tensor-parallel layout reported", "TP map")
    ranks = [f"rank {r.rank}" for r in tp_layout]
    traces = []
    for r in tp_layout:
        colour = PALETTE[r.rank % len(PALETTE)]
        hover = (f"rank {r.rank}<br>KV cache {fmt_bytes(r.kv_cache_bytes)}"
                 f"<br>vocab [{r.vocab_slice[0]}, {r.vocab_slice[1]})")
        for axis, heads in (("", r.q_heads), ("2", r.kv_heads)):
            traces.append(scatter(
                x=heads, y=[f"rank {r.rank}"] * len(heads), mode="markers", showlegend=False,
                marker=dict(symbol="square", size=14, color=colour), xaxis=f"x{axis}",
                yaxis=f"y{axis}", hovertemplate=f"head %{{x}}<br>{hover}<extra></extra>"))
        sl = r.expert_slice or r.mlp_slice
        if sl is not None:
            what = "each expert" if r.expert_slice else "MLP"
            traces.append(bar(
                y=[f"rank {r.rank}"], x=[sl[1] - sl[0]], base=[sl[0]], orientation="h",
                marker_color=colour, showlegend=False, xaxis="x3", yaxis="y3",
                hovertemplate=f"[{sl[0]}, {sl[1]}) of {what}<extra></extra>"))
    cat = dict(type="category", categoryorder="array", categoryarray=ranks,
               autorange="reversed")
    # three stacked panels laid out by hand: query heads, KV heads, intermediate slices
    panels = [(0.78, 1.0), (0.42, 0.60), (0.0, 0.20)]   # gaps leave room for tick labels
    titles = ["query heads", "KV heads", "MLP / expert intermediate slice"]
    notes = [dict(text=t, x=0.5, y=hi + 0.02, xref="paper", yref="paper", showarrow=False,
                  xanchor="center", yanchor="bottom", font=dict(size=12))
             for t, (_, hi) in zip(titles, panels)]
    return make_figure(
        traces, f"Tensor-parallel map ({len(tp_layout)} rank{'s' if len(ranks) > 1 else ''})",
        uirevision="engine-tp", height=max(340, 3 * 34 * len(ranks) + 240), annotations=notes,
        margin=dict(l=70, r=20, t=50, b=40),
        # no zero line on the head axes: it struck through head 0's marker
        xaxis=dict(range=[-0.5, max(num_heads, 1) - 0.5], anchor="y", zeroline=False,
                   dtick=1 if num_heads <= 32 else None),
        yaxis=dict(domain=panels[0], **cat),
        xaxis2=dict(range=[-0.5, max(num_kv_heads, 1) - 0.5], anchor="y2", zeroline=False,
                    dtick=1 if num_kv_heads <= 32 else None),
        yaxis2=dict(domain=panels[1], **cat),
        xaxis3=dict(title="intermediate dim", anchor="y3"),
        yaxis3=dict(domain=panels[2], **cat))
