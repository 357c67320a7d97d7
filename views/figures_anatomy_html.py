"""Pure HTML builders for the Anatomy tab: tokens and ids, weights and code tables, the KV
layout and a block's owner, the per-rank table and the published shapes (the token-path
diagram is in figures_anatomy_path.py). Inline styles only: the tab needs no stylesheet."""
from __future__ import annotations

import html
import re
from typing import Callable, Sequence

from engine.anatomy import (CodeRef, KVDataPlane, ModelAnatomy, ShapeRow, TokenPiece, TPPlan,
                            Vocabulary, WeightBreakdown)
from views.figures_anatomy import GROUP_COLOURS, fmt_bytes, fmt_count
from views.figures_common import PALETTE, short_text

MONO = "font-family:ui-monospace,monospace"
TABLE = "border-collapse:collapse;font-size:12px;width:100%"
TH = "text-align:left;border-bottom:2px solid #dee2e6;padding:3px 6px;color:#495057"
TD = "border-bottom:1px solid #eee;padding:3px 6px;vertical-align:top"
MUTED = "color:#6c757d"
LIVE = "background:#e6f4ea;color:#1e6b34;border-radius:4px;padding:0 4px;" + MONO


def esc(x) -> str:
    return html.escape(str(x), quote=True)


def esc_code(x) -> str:
    """A code path or symbol, escaped, with a line-break opportunity after each `/`, `.`, `_`
    and `:`: a long name wraps between its parts, never mid-word."""
    return re.sub(r"([/._:])", r"\1<wbr>", esc(x))


def _table(head: Sequence[str], rows: Sequence[Sequence[str]], elem: str = "",
           wide: bool = True, font_px: int = 12) -> str:
    h = "".join(f'<th style="{TH}">{c}</th>' for c in head)
    body = "".join("<tr>" + "".join(f'<td style="{TD}">{c}</td>' for c in r) + "</tr>"
                   for r in rows)
    cls = f' class="{elem}"' if elem else ""
    style = TABLE.replace("12px", f"{font_px}px")
    style = style if wide else style.replace("width:100%", "width:auto")
    return f'<table{cls} style="{style}"><tr>{h}</tr>{body}</table>'


def _chip(piece: TokenPiece, colour: str = "#e9ecef") -> str:
    bg = "#212529" if piece.special else colour
    fg = "#ffffff" if piece.special else "#212529"
    return (f'<span class="anat-tok" data-id="{piece.id}" style="display:inline-flex;'
            f'flex-direction:column;align-items:center;margin:2px;padding:1px 5px;'
            f'border-radius:4px;background:{bg};{MONO};font-size:12px">'
            f'<span style="color:{fg}">{esc(short_text(piece.text, 16))}</span>'
            f'<span style="font-size:10px;color:{fg};opacity:.75">{piece.id}</span></span>')


# ---- 1. vocabulary, weights, code -----------------------------------------------------------

def tokens_html(pieces: Sequence[TokenPiece]) -> str:
    if not pieces:
        return f'<div style="{MUTED}">no tokens</div>'
    chips = "".join(_chip(p, PALETTE[i % 2 + 14] + "33") for i, p in enumerate(pieces))
    return (f'<div class="anat-tokens">{chips}</div><div style="{MUTED};font-size:12px">'
            f'{len(pieces)} tokens · ids: <span style="{MONO}">'
            f'{esc(" ".join(str(p.id) for p in pieces))}</span></div>')


def vocabulary_html(v: Vocabulary) -> str:
    size = f"<b>{v.vocab_size:,}</b> embedding rows (config <code>vocab_size</code>)"
    if v.tokenizer_size is not None:
        size += f" · the tokenizer produces <b>{v.tokenizer_size:,}</b> ids"
        if v.unused_rows:
            size += f" ({v.unused_rows:,} rows no text reaches: padding for fast matmuls)"
    else:
        size += " · no tokenizer: prompts are token ids"
    special = "".join(_chip(p) for p in v.special) or f'<span style="{MUTED}">none</span>'
    eos = ", ".join(map(str, v.eos_ids)) or "—"
    out = [f"<div>{size}</div>",
           f"<div style='margin-top:6px'>special tokens: {special} · generation stops at ids "
           f"<b>{esc(eos)}</b></div>"]
    if v.chat_text is not None:
        convo = " · ".join(f"<b>{esc(m['role'])}</b>: {esc(m['content'])}"
                           for m in v.chat_messages)
        out.append(f"<div style='margin-top:6px'>the chat template wraps {convo} into "
                   f"{len(v.chat_pieces)} tokens (special ones dark):</div>"
                   f"<div>{''.join(_chip(p) for p in v.chat_pieces)}</div>")
    return f'<div class="anat-vocab" style="font-size:13px">{"".join(out)}</div>'


def weights_table_html(w: WeightBreakdown) -> str:
    rows = []
    for p in w.parts:
        shape = " + ".join("[" + " × ".join(map(str, s)) + "]" for s in p.shapes)
        where = f"{p.instances} layers" if p.layers else "once"
        dot = (f'<span style="display:inline-block;width:9px;height:9px;border-radius:2px;'
               f'background:{GROUP_COLOURS.get(p.group, "#888")}"></span> ')
        params = f"tied to {p.tied_to}" if p.tied_to else f"{p.params:,}"
        active = f"{p.active_params:,}" if p.experts else "all"
        rows.append([dot + esc(p.label), f'<span style="{MONO}">{shape}</span>', where, params,
                     fmt_bytes(p.params * w.elem_bytes), active])
    rows.append(["<b>total</b>", "", "", f"<b>{w.total_params:,}</b>",
                 f"<b>{fmt_bytes(w.total_bytes)}</b>", f"<b>{w.active_params:,}</b>"])
    return _table(["part", "shape (checkpoint layout)", "where", "parameters",
                   f"bytes ({w.dtype})", "read per token"], rows, "anat-weights-table")


def _kernel_list(refs) -> str:
    """Kernels grouped per file: `kernels/rmsnorm.py: rms_norm_ref, fused_add_rms_norm_ref`."""
    files: dict[str, list[str]] = {}
    for k in refs:
        files.setdefault(k.path, []).append(f"{esc_code(k.function)} <span style='{MUTED}'>"
                                            f"({k.kind})</span>")
    return "<br>".join(f'<span style="{MONO}" title="{esc(path)}">'
                       f'{esc_code(path.replace("engine/", "", 1))}</span>: ' + ", ".join(fns)
                       for path, fns in files.items())


def code_table_html(code: Sequence[CodeRef], device: str) -> str:
    """Stage → engine file and class → the kernel that runs here (and the other device's)."""
    rows = []
    for c in code:
        here = c.kernels_on(device)
        other = [k for k in c.kernels if k not in here]
        run = _kernel_list(here) or (f'<span style="{MONO}">{esc(", ".join(c.torch_ops))}</span>'
                                     if c.torch_ops else f'<span style="{MUTED}">torch ops in '
                                     f'{esc_code(c.path)}</span>')
        if here and c.torch_ops:
            run += f'<br><span style="{MONO}">{esc(", ".join(c.torch_ops))}</span>'
        via = "".join(f'<br><span style="{MUTED}">via {esc(h)}</span>' for h in c.helpers)
        coll = (f'<br><span style="color:#d62728">then {c.collective} across ranks (TP &gt; 1)'
                f'</span>' if c.collective else "")
        rows.append([f"<b>{esc(c.key)}</b><br><span style='{MUTED}'>{esc(c.stage)}</span>",
                     f'<span style="{MONO}">{esc_code(c.path)}</span><br>{esc_code(c.symbol)}{via}{coll}',
                     run, _kernel_list(other) or "—"])
    dev = "GPU" if device.startswith("cuda") else "CPU"
    return _table(["stage", "engine code", f"runs here ({dev})", "on the other device"], rows,
                  "anat-code-table", font_px=11)


# ---- 3. KV data plane ------------------------------------------------------------------------

def kv_plane_html(p: KVDataPlane, tp: int) -> str:
    names = ["K/V", "layer", "block", "slot", "KV head", "head dim"]
    rows = [[n, str(s), f"{st:,}", f"{bst:,}"]
            for n, s, st, bst in zip(names, p.shape, p.strides, p.byte_strides)]
    rank = " (rank 0's: its KV heads)" if tp > 1 else ""
    head = (f"<div style='font-size:13px'>the cache tensor{rank}: <span style='{MONO}'>"
            f"{esc(list(p.shape))}</span> {esc(p.dtype)}, {fmt_bytes(p.total_bytes)} "
            f"({p.total_bytes:,} bytes). One logical block = {2 * p.num_layers} regions of "
            f"{p.region_bytes:,} bytes = {fmt_bytes(p.block_bytes)} per block.</div>")
    return head + _table(["dim", "size", "stride (elements)", "stride (bytes)"], rows,
                         "anat-kv-strides", wide=False)


def block_info_html(block, block_size: int, decode: Callable[[Sequence[int]], str],
                    first_values: Sequence[float] | None = None, first_offset: int = 0,
                    special_ids: frozenset[int] = frozenset()) -> str:
    """Who owns a block and which tokens it holds (from the engine snapshot's BlockInfo)."""
    if block is None:
        return f'<div style="{MUTED}">no such block</div>'
    owners = ", ".join(block.owners) or "nobody"
    state = ("free, still holds a cached prefix (evictable)" if block.evictable else
             "free" if block.ref_count == 0 else f"in use, ref count {block.ref_count}")
    toks = "".join(_chip(TokenPiece(t, decode([t]), t in special_ids)) for t in block.token_ids)
    out = (f'<div class="anat-block" data-block="{block.block_id}" style="font-size:13px">'
           f"block <b>{block.block_id}</b>: {state} · owner requests: <b>{esc(owners)}</b> · "
           f"{block.num_filled}/{block_size} slots filled"
           + (f" · prefix hash {block.prefix_hash & 0xffffffff:08x}"
              if block.prefix_hash is not None else "") + "</div>")
    if block.hidden:
        out += (f'<div style="{MUTED}">a private request\'s block (sent with a cache_salt): '
                f'its text and numbers are not shown</div>')
    else:
        out += f"<div>{toks}</div>" if toks else f'<div style="{MUTED}">no tokens held</div>'
    if first_values is not None:
        vals = ", ".join(f"{x:.4g}" for x in first_values)
        out += (f"<div style='font-size:12px;margin-top:4px'>raw bytes at offset "
                f"{first_offset:,} (K of layer 0, slot 0, head 0), read as numbers: "
                f"<span style='{MONO}'>[{vals}]</span></div>")
    return out


# ---- 4. tensor parallelism -------------------------------------------------------------------

def _span(sl) -> str:
    return f"[{sl[0]}, {sl[1]})" if sl else "—"


def tp_table_html(plan: TPPlan, a: ModelAnatomy) -> str:
    if not plan.possible:
        return f'<div style="color:#d62728">TP {plan.tp} is not possible: {esc(plan.reason)}</div>'
    dense, moe = "dense" in a.arch.mlp_kinds, a.arch.is_moe
    head = ["rank", "query heads", "KV heads"] + (["MLP slice"] if dense else []) + \
        (["each expert's slice"] if moe else []) + ["vocab rows", "params", "weights",
                                                    "KV cache"]
    rows = []
    for r in plan.ranks:
        lay = r.layout
        row = [str(lay.rank), esc(lay.q_heads), esc(lay.kv_heads)]
        row += [_span(lay.mlp_slice)] if dense else []
        row += [f"{_span(lay.expert_slice)} × {a.arch.num_experts}"] if moe else []
        row += [_span(lay.vocab_slice), fmt_count(r.params), fmt_bytes(r.weight_bytes),
                fmt_bytes(lay.kv_cache_bytes)]
        rows.append(row)
    notes = [f"{plan.q_heads_per_rank} query heads and {plan.kv_heads_per_rank} KV head(s) per "
             f"rank"]
    if plan.kv_replicas > 1:
        notes.append(f"<b>KV heads replicated</b>: tp = {plan.tp} > {a.arch.num_kv_heads} KV "
                     f"heads, so {plan.kv_replicas} ranks hold a copy of each")
    fit = (f"fits one GPU: {fmt_bytes(plan.weight_bytes_per_rank)} of weights per rank, room "
           f"for {plan.kv_tokens_that_fit:,} tokens of KV cache" if plan.fits else
           f"<b style='color:#d62728'>does not fit</b>: {fmt_bytes(plan.weight_bytes_per_rank)}"
           f" per rank > {fmt_bytes(plan.budget_bytes)}")
    coll = "".join(f"<li><span style='{MONO}'>{esc_code(c.where)}</span> ({esc_code(c.symbol)}): "
                   f"<b>{c.op}</b>{' in each of ' + str(c.count) + ' layers' if c.layers else ''}"
                   f"</li>" for c in plan.collectives)
    return (_table(head, rows, "anat-tp-table")
            + f"<div style='font-size:12px;margin-top:4px'>{' · '.join(notes)} · {fit}</div>"
            + f"<div style='font-size:12px'>collectives of one forward at TP &gt; 1 "
              f"({plan.collectives_per_forward if plan.tp > 1 else 0} at TP {plan.tp}):"
              f"<ul style='margin:2px 0'>{coll}</ul></div>")


# ---- 5. depth vs width -----------------------------------------------------------------------

def shapes_table_html(rows: Sequence[ShapeRow], source: str) -> str:
    out = []
    for r in rows:
        a = r.arch
        ffn = (f"{a.num_experts} × {a.moe_intermediate_size}, top-{a.top_k}" if a.is_moe
               else f"{a.intermediate_size}")
        if a.shared_expert_intermediate_size:
            ffn += f" + shared {a.shared_expert_intermediate_size}"
        card = (f" (card {r.card_total}" + (f", {r.card_active} active" if r.card_active else "")
                + ")") if r.card_total else ""
        name = f"<b>{esc(r.name)}</b> (loaded, live)" if r.loaded else esc(r.name)
        out.append([name, str(a.num_layers), str(a.hidden_size), f"{a.num_heads} / "
                    f"{a.num_kv_heads}", str(a.head_dim), ffn,
                    fmt_count(r.total_params) + card, fmt_count(r.active_params),
                    str(r.min_tp_h200 or "> 8")])
    return (_table(["model", "layers", "hidden", "heads / KV", "head dim", "MLP or experts",
                    "parameters", "per token", "TP to fit an H200 (bf16)"], out,
                   "anat-shapes-table")
            + f"<div style='{MUTED};font-size:11px'>{esc(source)}</div>")
