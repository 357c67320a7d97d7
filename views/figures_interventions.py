"""The "What if" comparison's figure: both runs at the token where they part, drawn with the
same look as every other chart (views/figures_common.py) and shown in a live plot."""
from __future__ import annotations

import numpy as np

from views.figures_common import Figure, legend_title, make_figure, plotly_text, scatter

UNTOUCHED, INTERVENED = "#4e79a7", "#e15759"


def overlay_figure(ta, tb, step: int, decode) -> Figure:
    """Two panels at reply token `step` (both runs share every token before it, so any
    difference is the intervention's): left, ||resid|| after each layer of the query that
    predicts it; right, the logit lens — per layer, the probability of each run's own token,
    hovering the layer's top token.

    Where the edit changes little both lines coincide (often near p = 1): the untouched run is
    a wide pale band and the intervened one a thin dashed line with open markers on top, so
    neither hides the other."""
    styles = (("untouched", dict(color=UNTOUCHED, width=7), dict(size=9, opacity=0.45), 0.45),
              ("intervened", dict(color=INTERVENED, width=2, dash="dash"),
               dict(size=8, symbol="circle-open", line=dict(width=2)), 1.0))
    data = []
    row = len(ta.prompt_token_ids) - 1 + step          # the query position of reply token `step`
    for (name, line, marker, opacity), tr in zip(styles, (ta, tb)):
        n = tr.norms()
        if row < len(n):
            data.append(scatter(x=["embed"] + [str(i) for i in range(tr.num_layers)],
                                y=n[row].tolist(), name=f"{name} ‖resid‖", mode="lines+markers",
                                line=line, marker=marker, opacity=opacity, xaxis="x", yaxis="y",
                                hovertemplate=f"{name}<br>after %{{x}}: %{{y:.3g}}<extra></extra>"))
        if step < len(tr.lens):
            st = tr.lens[step]
            tops = [plotly_text(repr(decode([int(t)]))) for t in np.asarray(st.top_ids)[:, 0]]
            own = plotly_text(repr(decode([st.sampled_token])))
            data.append(scatter(x=list(range(tr.num_layers)),
                                y=np.asarray(st.sampled_prob).tolist(),
                                name=f"{name}: p({own})", mode="lines+markers", line=line,
                                marker=marker, opacity=opacity, text=tops, xaxis="x2",
                                yaxis="y2",
                                hovertemplate=f"{name}: p({own}) = %{{y:.3f}} at layer %{{x}}"
                                              "<br>top: %{text}<extra></extra>"))
    title = legend_title(f"Reply token {step}: residual norms and logit lens, both runs",
                         {"untouched": UNTOUCHED, "intervened": INTERVENED})
    return make_figure(
        data, title, uirevision="iv-overlay", height=320, margin=dict(l=60, r=20, t=64, b=44),
        xaxis=dict(domain=[0, 0.44], title="after layer", type="category"),
        yaxis=dict(title="‖resid‖"),
        xaxis2=dict(domain=[0.56, 1], title="layer", anchor="y2", dtick=1),
        yaxis2=dict(anchor="x2", range=[0, 1.05], title="p(own token)"))
