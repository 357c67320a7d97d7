"""InterventionPlan: what the forward edits in one step, as small host tables built on rank 0
and sent to every rank. Every token of the step points (`sel`) at one row of the tables; row 0
is the identity, so untouched requests compute exactly what they would without it. Requests
with the same interventions share a row; a request whose steering depends on the position
class (prompt / generated) gets one row per class.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .spec import CAPTURE, Intervention, ModelFacts


@dataclass
class InterventionPlan:
    """Host tables for one step (R rows, row 0 the identity)."""
    ablate_layers: tuple[int, ...]          # La layers with an ablation this step
    expert_layers: tuple[int, ...]          # Le
    steer_layers: tuple[int, ...]           # Ls
    sel: np.ndarray                         # [N] int64: table row of each flat token
    head_keep: np.ndarray | None            # [R, La, num_heads] fp32: 1 keep, 0 ablate
    expert_bias: np.ndarray | None          # [R, Le, num_experts] fp32: 0, or -inf (masked)
    steer_add: np.ndarray | None            # [R, Ls, hidden] fp32: vector * scale, or 0
    steer_on: np.ndarray | None             # [R, Ls] bool: this row adds at this layer
    clamp_layers: tuple[int, ...] = ()      # Lc layers with an attention clamp this step
    clamp_heads: np.ndarray | None = None   # [R, Lc, num_heads] bool: this head is clamped
    clamp_keys: np.ndarray | None = None    # [R, Lc, P] int64: key positions it sees, -1 pad
    # (batch index, layer, first flat row, rows): prompt tokens whose resid_post is summed
    captures: list[tuple[int, int, int, int]] = field(default_factory=list)

    @property
    def key(self) -> tuple:
        """What a CUDA graph captures: which layers edit what (not the tables' values)."""
        return (self.ablate_layers, self.expert_layers, self.steer_layers, self.clamp_layers)

    @property
    def num_rows(self) -> int:
        return max((t.shape[0] for t in (self.head_keep, self.expert_bias, self.steer_add,
                                         self.clamp_heads) if t is not None), default=1)


class InterventionPlanner:
    """Rank 0's host side: knows which live requests have interventions (so a step without any
    costs one truthiness test), builds each step's plan, folds captured residuals back."""

    def __init__(self, facts: ModelFacts):
        self.facts = facts
        self.live: set = set()          # Sequences with interventions, not yet seen finished

    def add(self, seq) -> None:
        if seq.interventions:
            self.live.add(seq)

    @property
    def active(self) -> bool:
        if self.live:
            self.live = {s for s in self.live if not s.is_finished}
        return bool(self.live)

    def plan(self, scheduled) -> InterventionPlan | None:
        """The step's tables, or None when no scheduled request has an intervention."""
        if not any(s.seq.interventions for s in scheduled):
            return None
        f = self.facts
        entries, total = [], 0
        for b, s in enumerate(scheduled):
            if s.seq.interventions:
                entries.append((b, s, total))
            total += s.num_tokens
        all_ivs = [iv for _, s, _ in entries for iv in s.seq.interventions]
        la = tuple(sorted({iv.layer for iv in all_ivs if iv.kind == "ablate_heads"}))
        le = tuple(sorted({iv.layer for iv in all_ivs if iv.kind == "mask_experts"}))
        lc = tuple(sorted({iv.layer for iv in all_ivs if iv.kind == "clamp_attention"}))
        sel = np.zeros(total, dtype=np.int64)
        rows: dict[tuple, int] = {}
        specs: list[tuple[tuple[Intervention, ...], str]] = []
        captures = []
        for b, s, row0 in entries:
            seq, n, start = s.seq, s.num_tokens, s.start
            ivs = seq.interventions
            P = seq.num_prompt_tokens
            # the request's edits differ between prompt and generated positions
            split = any(iv.kind == "steer" and iv.positions != "all" for iv in ivs)
            for cls_name, lo, hi in (("prompt", start, min(start + n, P)),
                                     ("generated", max(start, P), start + n)):
                if hi <= lo:
                    continue
                cls_key = cls_name if split else "all"
                # the chain root names the intervention set (requests with the same edits
                # share a row); a user's cache_salt mixed into it only splits rows that could
                # have been shared, each still holding its request's own edits
                key = (seq.cache_salt, cls_key)
                if key not in rows:
                    rows[key] = len(specs) + 1
                    specs.append((ivs, cls_name))
                sel[row0 + lo - start:row0 + hi - start] = rows[key]
            for iv in ivs:
                if iv.kind == CAPTURE and start < P:
                    captures.append((b, iv.layer, row0, min(start + n, P) - start))
        # steering layers that add somewhere this step ("prompt" steering is off in decode)
        ls = tuple(sorted({iv.layer for ivs, cls_name in specs for iv in ivs
                           if iv.kind == "steer" and iv.positions in ("all", cls_name)}))
        if not (la or le or ls or lc or captures):
            return None     # e.g. a steering-vector request's decode step: nothing to edit
        R = len(specs) + 1
        keep = np.ones((R, len(la), f.num_heads), np.float32) if la else None
        bias = np.zeros((R, len(le), f.num_experts), np.float32) if le else None
        add = np.zeros((R, len(ls), f.hidden_size), np.float32) if ls else None
        on = np.zeros((R, len(ls)), bool) if ls else None
        clamp_heads = clamp_keys = None
        if lc:
            width = max(len(iv.key_positions) for iv in all_ivs if iv.kind == "clamp_attention")
            clamp_heads = np.zeros((R, len(lc), f.num_heads), bool)
            clamp_keys = np.full((R, len(lc), width), -1, np.int64)
        for r, (ivs, cls_name) in enumerate(specs, start=1):
            for iv in ivs:
                if iv.kind == "ablate_heads":
                    keep[r, la.index(iv.layer), list(iv.heads)] = 0.0
                elif iv.kind == "mask_experts":
                    bias[r, le.index(iv.layer), list(iv.experts)] = -np.inf
                elif iv.kind == "clamp_attention":
                    # resolve_interventions made a request's clamps at one layer share their
                    # positions: the key row is either empty or already these
                    j = lc.index(iv.layer)
                    clamp_keys[r, j, :len(iv.key_positions)] = iv.key_positions
                    clamp_heads[r, j, list(iv.heads)] = True
                elif iv.kind == "steer" and iv.positions in ("all", cls_name):
                    j = ls.index(iv.layer)
                    # vector * scale in fp32, the same product a reference hook computes
                    add[r, j] += iv.vector * np.float32(iv.scale)
                    on[r, j] = True
        return InterventionPlan(la, le, ls, sel, keep, bias, add, on, clamp_layers=lc,
                                clamp_heads=clamp_heads, clamp_keys=clamp_keys, captures=captures)

    @staticmethod
    def fold(plan: InterventionPlan, captured, scheduled) -> None:
        """Add one step's captured resid_post sums ([C, hidden] host, in plan.captures order)
        to their requests (`seq.resid_capture`, fp64 [hidden])."""
        if captured is None or not plan.captures:
            return
        arr = captured.numpy() if hasattr(captured, "numpy") else np.asarray(captured)
        for (b, _, _, _), row in zip(plan.captures, arr):
            seq = scheduled[b].seq
            prev = seq.resid_capture
            seq.resid_capture = row.astype(np.float64) if prev is None else prev + row
