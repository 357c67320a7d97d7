"""InterventionBuffers: one step's InterventionPlan tables on one rank's device, and the edits
the layers call:

  attention output [N, Hq, D] *= head_keep[sel]      (before o_proj; this rank's heads)
  router logits    [N, E]     += expert_bias[sel]    (0 or -inf, before softmax and top-k)
  layer output     [N, H]     += steer_add[sel]      (where steer_on[sel]; = hook_resid_post)
  attention output [N, Hq, D] = clamped attention    (where clamp_heads[sel]; attention_clamp.py)

Untouched tokens gather the identity row (x * 1, x + 0, or the `where` keeps x), so they
compute bit for bit what they would without the intervention.
"""
from __future__ import annotations

import numpy as np
import torch

from .attention_clamp import clamped_attention, token_seq_and_pos
from .plan import InterventionPlan
from .spec import MAX_CLAMP_POSITIONS


class InterventionBuffers:
    def __init__(self, plan: InterventionPlan, device, dtype, head_slice: slice,
                 capture_out: bool = True):
        self.plan = plan
        self.device, self.dtype, self.head_slice = device, dtype, head_slice
        self.ablate_index = {l: i for i, l in enumerate(plan.ablate_layers)}
        self.expert_index = {l: i for i, l in enumerate(plan.expert_layers)}
        self.steer_index = {l: i for i, l in enumerate(plan.steer_layers)}
        self.clamp_index = {l: i for i, l in enumerate(plan.clamp_layers)}
        self.capture_layers = {c[1] for c in plan.captures} if capture_out else set()
        self.captured: list[torch.Tensor] = []      # [hidden] fp32 sums, plan.captures order
        to = self._to_device
        self.sel = to(plan.sel)                                         # [N] int64
        self.head_keep = (to(plan.head_keep[:, :, head_slice], dtype)
                          if plan.head_keep is not None else None)     # [R, La, Hq_rank]
        self.expert_bias = to(plan.expert_bias) if plan.expert_bias is not None else None
        self.steer_add = to(plan.steer_add, dtype) if plan.steer_add is not None else None
        self.steer_on = to(plan.steer_on) if plan.steer_on is not None else None
        self.clamp_heads = (to(plan.clamp_heads[:, :, head_slice])
                            if plan.clamp_heads is not None else None)  # [R, Lc, Hq_rank]
        self.clamp_keys = to(plan.clamp_keys) if plan.clamp_keys is not None else None
        # per clamped layer, the token rows of the requests that clamp it (eager steps compute
        # only those); None: every row (graphs: the rows change each replay)
        self.clamp_rows: list[torch.Tensor | None] = [
            to(np.flatnonzero(np.isin(plan.sel, np.flatnonzero(plan.clamp_heads[:, i].any(-1)))))
            for i in range(len(plan.clamp_layers))]

    def _to_device(self, a: np.ndarray, dtype=None) -> torch.Tensor:
        t = torch.from_numpy(np.ascontiguousarray(a))
        if self.device.type != "cpu":
            t = t.pin_memory().to(self.device, non_blocking=True)
        return t if dtype is None else t.to(dtype)

    @classmethod
    def for_step(cls, runner, plan: InterventionPlan) -> "InterventionBuffers":
        return cls(plan, runner.device, runner.dtype, head_slice_of(runner),
                   capture_out=runner.tp.rank == 0)

    # ---- the edits (called from the forward) ----------------------------------------------
    def ablate(self, layer: int, o: torch.Tensor) -> torch.Tensor:
        """o [N, Hq, D] (this rank's heads) -> o with ablated heads zeroed."""
        i = self.ablate_index.get(layer)
        if i is None:
            return o
        keep = self.head_keep[:, i].index_select(0, self.sel)          # [N, Hq]
        return o * keep.unsqueeze(-1)

    def clamp(self, layer: int, q: torch.Tensor, o: torch.Tensor, k_cache: torch.Tensor,
              v_cache: torch.Tensor, ctx, scale: float) -> torch.Tensor:
        """o [N, Hq, D] (this rank's heads, from the attention kernel) -> o with the clamped
        heads of the clamping requests' tokens recomputed over their chosen keys only."""
        i = self.clamp_index.get(layer)
        if i is None:
            return o
        rows = self.clamp_rows[i]
        seq, pos = token_seq_and_pos(ctx, o.shape[0], o.device)
        sel, qr, orows = self.sel, q, o
        if rows is not None:
            if rows.numel() == 0:
                return o
            sel, seq, pos, qr, orows = sel[rows], seq[rows], pos[rows], q[rows], o[rows]
        heads = self.clamp_heads[:, i].index_select(0, sel)            # [n, Hq]
        keys = self.clamp_keys[:, i].index_select(0, sel)              # [n, P]
        c = clamped_attention(qr, k_cache, v_cache, ctx.block_tables, seq, pos, keys, scale)
        new = torch.where(heads.unsqueeze(-1), c, orows)
        return new if rows is None else o.index_copy(0, rows, new)

    def router_bias(self, layer: int) -> torch.Tensor | None:
        """[N, E] fp32 to add to the router logits at `layer`, or None."""
        i = self.expert_index.get(layer)
        if i is None:
            return None
        return self.expert_bias[:, i].index_select(0, self.sel)

    def layer_out(self, layer: int, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] is decoder layer `layer`'s last sublayer output; hidden + residual is
        its resid_post. Returns hidden with the steering added (and captures the prompt's
        resid_post for steering vectors)."""
        if layer in self.capture_layers:
            resid = hidden + residual                                   # what the next norm adds
            for _, l, start, n in self.plan.captures:
                if l == layer:
                    self.captured.append(resid[start:start + n].float().sum(0))
        i = self.steer_index.get(layer)
        if i is None:
            return hidden
        add = self.steer_add[:, i].index_select(0, self.sel)           # [N, H]
        on = self.steer_on[:, i].index_select(0, self.sel)             # [N]
        return torch.where(on.unsqueeze(-1), hidden + add, hidden)

    # ---- after the forward (rank 0) ------------------------------------------------------------
    def captured_sums(self) -> torch.Tensor | None:
        """[C, hidden] fp32 in plan.captures order (still on the device), or None."""
        return torch.stack(self.captured) if self.captured else None


def head_slice_of(runner) -> slice:
    """The query heads this rank holds (QKVParallelLinear splits them contiguously)."""
    n = runner.num_heads
    return slice(runner.tp.rank * n, (runner.tp.rank + 1) * n)


# ---- CUDA-graph variant ----------------------------------------------------------------------
class GraphInterventionBuffers(InterventionBuffers):
    """Static tables for one plan key, `max_rows` token rows and table rows: captured into
    a decode graph, refilled before each replay by one copy per table."""

    def __init__(self, key: tuple, max_rows: int, facts, device, dtype, head_slice: slice):
        la, le, ls, lc = key
        R = max_rows + 1
        plan = InterventionPlan(
            la, le, ls, np.zeros(max_rows, np.int64),
            np.ones((R, len(la), facts.num_heads), np.float32) if la else None,
            np.zeros((R, len(le), facts.num_experts), np.float32) if le else None,
            np.zeros((R, len(ls), facts.hidden_size), np.float32) if ls else None,
            np.zeros((R, len(ls)), bool) if ls else None, clamp_layers=lc,
            clamp_heads=np.zeros((R, len(lc), facts.num_heads), bool) if lc else None,
            clamp_keys=np.full((R, len(lc), MAX_CLAMP_POSITIONS), -1, np.int64) if lc else None)
        super().__init__(plan, device, dtype, head_slice, capture_out=False)
        self.clamp_rows = [None] * len(lc)
        self.max_rows = max_rows

    def view(self, bs: int) -> "GraphInterventionBuffers":
        """The buffers a graph of bucket `bs` captures: sel cut to its rows."""
        v = object.__new__(GraphInterventionBuffers)
        v.__dict__.update(self.__dict__)
        v.sel = self.sel[:bs]
        return v

    def load_plan(self, plan: InterventionPlan) -> None:
        """Copy this step's tables into the static buffers (rows past the plan's keep what
        they held: no token selects them). Padded token rows select row 0, the identity. The
        graph runner's can_run admitted the plan: its key and at most max_rows + 1 rows."""
        n, R = len(plan.sel), plan.num_rows
        sel = np.zeros(self.max_rows, np.int64)
        sel[:n] = plan.sel
        pairs = [(self.sel, sel)]
        if self.head_keep is not None:
            pairs.append((self.head_keep[:R], plan.head_keep[:, :, self.head_slice]))
        if self.expert_bias is not None:
            pairs.append((self.expert_bias[:R], plan.expert_bias))
        if self.steer_add is not None:
            pairs += [(self.steer_add[:R], plan.steer_add), (self.steer_on[:R], plan.steer_on)]
        if self.clamp_heads is not None:
            keys = np.full(self.clamp_keys[:R].shape, -1, np.int64)   # the plan's, -1 padded
            keys[:, :, :plan.clamp_keys.shape[2]] = plan.clamp_keys
            pairs += [(self.clamp_heads[:R], plan.clamp_heads[:, :, self.head_slice]),
                      (self.clamp_keys[:R], keys)]
        for dst, src in pairs:
            # fresh pinned memory each step: the copy of the step before may not have run yet
            h = torch.from_numpy(np.ascontiguousarray(src)).to(dst.dtype)   # cast on the host
            h = h.pin_memory() if dst.is_cuda else h
            dst.copy_(h, non_blocking=True)
