"""The path of one token as an HTML diagram: token id -> embedding -> L layers -> final norm
-> LM head -> sampling, and inside one layer (attention with its GQA groups, the dense MLP,
the MoE block), each stage with its shape and the code that runs it; the watched token's live
numbers (residual norms, logit-lens top token, routed experts) in green when one is chosen."""
from __future__ import annotations

from typing import Sequence

from engine.anatomy import CodeRef, ModelAnatomy, PathStage
from views.figures_anatomy import LiveToken
from views.figures_anatomy_html import LIVE, MONO, MUTED, esc, esc_code
from views.figures_common import PALETTE, short_text


def _box(stage: PathStage, code: CodeRef | None, device: str, live: str = "",
         colour: str = "#dee2e6", extra: str = "") -> str:
    kern = ""
    if code is not None:
        ks = code.kernels_on(device)
        what = ", ".join(k.function for k in ks) or ", ".join(code.torch_ops) or code.symbol
        kern = (f'<div style="font-size:10px;{MUTED};{MONO};overflow-wrap:break-word" '
                f'title="{esc(code.path)}">'
                f'{esc_code(code.path.split("/")[-1])} · {esc_code(what)}</div>')
    note = f'<div style="font-size:11px;{MUTED}">{esc(stage.note)}</div>' if stage.note else ""
    live_html = f'<div style="margin-top:2px"><span style="{LIVE}">{live}</span></div>' \
        if live else ""
    box = (f"border:2px solid {colour};border-radius:6px;padding:4px 8px;flex:1 1 0;"
           "min-width:118px;max-width:230px;background:#fff")
    return (f'<div class="anat-stage" data-stage="{esc(stage.key)}" style="{box}">'
            f'<div style="font-weight:600;font-size:13px">{esc(stage.label)}</div>'
            f'<div style="{MONO};font-size:12px">{esc(stage.shape_text)}</div>{note}'
            f'{kern}{extra}{live_html}</div>')


def _flow(boxes: Sequence[str]) -> str:
    arrow = '<div style="align-self:center;font-size:18px;color:#adb5bd">→</div>'
    return ('<div style="display:flex;flex-wrap:wrap;gap:6px;align-items:stretch">'
            + arrow.join(boxes) + "</div>")


def _layer_cells(a: ModelAnatomy, live: LiveToken | None) -> str:
    cells = []
    for i, kind in enumerate(a.arch.mlp_kinds):
        text = f"L{i} {kind}"
        if live is not None and live.norms is not None and i + 1 < len(live.norms):
            text += f" ‖r‖ {live.norms[i + 1]:.3g}"
            if live.lens and i < len(live.lens):
                text += f" → {esc(short_text(live.lens[i][0], 8))} {live.lens[i][1]:.0%}"
            routed = {layer: e for layer, e, _ in (live.routed or [])}
            if i in routed:
                text += " · experts " + ",".join(map(str, routed[i]))
        cells.append(f'<span class="anat-layer" data-layer="{i}" style="{MONO};font-size:10px;'
                     f'border:1px solid #ced4da;border-radius:3px;padding:0 3px">{text}</span>')
    return ('<div style="display:flex;flex-direction:column;gap:2px;margin-top:3px;'
            'max-height:220px;overflow-y:auto">' + "".join(cells) + "</div>")


def token_path_html(a: ModelAnatomy, live: LiveToken | None = None) -> str:
    """token id → embedding → L layers → final norm → LM head → sampling, with shapes (and
    the watched token's live numbers: residual norms, logit-lens top token, routed experts)."""
    dev, boxes = a.device, []
    for st in a.path.outer:
        value, extra = "", ""
        if live is not None:
            n = live.norms
            if st.key == "token":
                value = f"{live.token_id} “{esc(short_text(live.text, 12))}” @ {live.position}"
            elif st.key == "embed" and n is not None:
                value = f"‖x‖ = {n[0]:.4g}"
            elif st.key == "final_norm" and n is not None:
                value = f"‖residual in‖ = {n[-1]:.4g}"
            elif st.key == "lm_head" and live.lens:
                value = f"top “{esc(short_text(live.lens[-1][0], 10))}” {live.lens[-1][1]:.0%}"
            elif st.key == "sample" and live.sampled is not None:
                value = f"“{esc(short_text(live.sampled, 12))}”"
        if st.key == "layers":
            extra = _layer_cells(a, live)
        boxes.append(_box(st, a.code_for(st.key), dev, value, extra=extra))
    return f'<div class="anat-path">{_flow(boxes)}</div>'


def _gqa_html(a: ModelAnatomy) -> str:
    if a.arch.num_heads > 64:
        return (f'<div style="{MUTED};font-size:12px">{a.arch.num_heads} query heads in '
                f'{a.arch.num_kv_heads} groups of {a.arch.gqa_group}</div>')
    groups = []
    for j, heads in enumerate(a.path.gqa):
        colour = PALETTE[j % len(PALETTE)]
        qs = "".join(f'<span title="query head {h}" style="display:inline-block;width:16px;'
                     f'height:16px;margin:1px;border-radius:3px;background:{colour};color:#fff;'
                     f'font-size:9px;text-align:center;line-height:16px">{h}</span>'
                     for h in heads)
        groups.append(f'<span class="anat-gqa" data-kv="{j}" style="display:inline-flex;'
                      f'align-items:center;gap:2px;border:1px dashed {colour};border-radius:4px;'
                      f'padding:1px 3px;margin:2px">{qs}<span style="font-size:10px">→ KV {j}'
                      f'</span></span>')
    return (f'<div style="font-size:12px">query heads grouped by the KV head they read '
            f'(GQA, {a.arch.gqa_group} per group):</div><div>{"".join(groups)}</div>')


def layer_html(a: ModelAnatomy, live: LiveToken | None = None) -> str:
    """Inside one decoder layer: attention, then the dense MLP and / or the MoE block."""
    dev = a.device
    attn = [_box(st, a.code_for(st.key), dev, colour="#f28e2b") for st in a.path.attention]
    parts = [f'<div style="font-weight:600;margin:6px 0 3px">attention (every layer)</div>'
             f'{_flow(attn)}{_gqa_html(a)}']
    if a.path.mlp:
        which = (f"layers {', '.join(map(str, a.path.dense_layers))}" if a.path.moe
                 else "every layer")
        mlp = [_box(st, a.code_for(st.key), dev, colour="#59a14f") for st in a.path.mlp]
        parts.append(f'<div style="font-weight:600;margin:6px 0 3px">dense MLP ({which})</div>'
                     f'{_flow(mlp)}')
    if a.path.moe:
        moe = []
        for st in a.path.moe:
            value = ""
            if st.key == "topk" and live is not None and live.routed:
                layer, experts, weights = live.routed[0]
                value = (f"L{layer}: " + ", ".join(f"{e} ({w:.2f})"
                                                   for e, w in zip(experts, weights)))
            moe.append(_box(st, a.code_for(st.key), dev, value, colour="#e15759"))
        layers = ", ".join(map(str, a.path.moe_layers))
        parts.append(f'<div style="font-weight:600;margin:6px 0 3px">MoE block (layers '
                     f'{layers})</div>{_flow(moe)}')
    return f'<div class="anat-layer-inside">{"".join(parts)}</div>'
