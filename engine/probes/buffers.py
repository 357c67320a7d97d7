"""ProbeBuffers: the device side of the probes, on every rank — what the forward writes into at
the hook points (residual norms, the lens' residual rows, the watched query's attention over the
paged K cache, MoE routing), the reductions over all layers after the forward, and the packed
buffer the host reads. Also the CUDA-graph variants: static buffers captured per probe set.
"""
from __future__ import annotations

import torch

from ..context import get_context
from ..kernels import attention_probe
from ..kernels.lens_stats import lens_stats, lens_stats_ref, sampled_stats, sampled_stats_ref
from .plan import ProbePlan


# steps with at most this many rows record routing for every row into stacked per-layer
# buffers the router writes directly (no launch per layer); bigger eager steps select rows
STACK_ROUTING_ROWS = 1024
# steps with at most this many rows keep each hook's residual (a new tensor every layer) and
# take the lens' rows from all of them at once in on_final: two launches instead of one copy
# per layer (29 at Qwen3-0.6B, 53 us a decode step on an H100: bench/RESULTS.md 2026-12-06
# day). Holding them costs (L + 1) x rows x hidden, so big prefills still copy per layer.
STACK_RESID_ROWS = 64


class ProbeBuffers:
    """Device-side outputs of one step's probes on one rank. Per layer, recording costs at most
    one launch (norms come from the norm kernel's own sum of squares, routing is written by the
    router); the reductions over all layers run once in `on_final`, which packs the small
    results into one flat buffer (`packed`) the host reads with one non-blocking copy."""

    def __init__(self, plan: ProbePlan, num_rows: int, num_layers: int, hidden: int, device,
                 dtype, moe_layers: list[int], num_experts: int, top_k: int):
        self.plan = plan
        self.device = device
        self.num_rows = num_rows
        R, W = len(plan.rows), len(plan.last_rows)
        C = len(plan.last_ctx)      # W with a watched verify in the step, else 0
        # rows | last_rows | last_batch | last_ctx in one device tensor: one host->device copy
        self.index = _to_device(torch.tensor(plan.rows + plan.last_rows + plan.last_batch +
                                             plan.last_ctx, dtype=torch.int64), device)
        self.rows, self.last_rows, self.last_batch, last_ctx = self.index.split([R, W, W, C])
        self.last_ctx = last_ctx.to(torch.int32) if C else None     # as context_lens
        self.sumsq = (torch.zeros(num_layers + 1, num_rows, device=device)
                      if plan.norms and R else None)
        self.norms = None                                   # [L + 1, R], set by on_final
        self.lens_resid = (torch.zeros(num_layers + 1, W, hidden, device=device, dtype=dtype)
                           if plan.lens and W else None)
        # hook index -> that hook's residual [N, H], while the lens stacks them (on_resid)
        self.resid_at: dict[int, torch.Tensor] | None = (
            {} if self.lens_resid is not None and num_rows <= STACK_RESID_ROWS else None)
        self.attn_layers = list(plan.attention_layers) if W else []
        self.attn_slot = {layer: i for i, layer in enumerate(self.attn_layers)}
        self.attn_layer_ids = _to_device(torch.tensor(self.attn_layers, dtype=torch.int32),
                                         device)
        self.q_rows = None                                  # [A, W, Hq, D], at first on_attention
        self.attn_ctx = None                                # the step's ForwardContext
        self.attn_probs = None                              # [A, W, Hq, max_ctx] after on_final
        # (layer, row_start) -> [Hq, m, start_pos + m]: one prefill chunk's rows of the pattern
        self.patterns: dict[tuple[int, int], torch.Tensor] = {}
        self.moe_index = {layer: i for i, layer in enumerate(moe_layers)}
        self.num_experts = num_experts
        m = len(moe_layers)
        self.record_routing = bool(plan.routing and R and m)
        self.record_load = bool(plan.expert_load and m)
        self.stacked = (self.record_routing or self.record_load) and num_rows <= STACK_ROUTING_ROWS
        if self.stacked:
            self.probs_all = torch.zeros(m, num_rows, num_experts, device=device)
            self.w_all = torch.zeros(m, num_rows, top_k, device=device)
            self.ids_all = torch.zeros(m, num_rows, top_k, dtype=torch.int32, device=device)
            self.gate_all = torch.zeros(m, num_rows, device=device)
        rec = self.record_routing and not self.stacked
        self.router_probs = torch.zeros(m, R, num_experts, device=device) if rec else None
        self.router_ids = torch.zeros(m, R, top_k, dtype=torch.int32, device=device) if rec else None
        self.router_w = torch.zeros(m, R, top_k, device=device) if rec else None
        self.shared_gate = torch.zeros(m, R, device=device) if rec else None
        self.has_shared_gate = False
        self.expert_load = (torch.zeros(m, num_experts, device=device)
                            if self.record_load and not self.stacked else None)
        self.lens_out = None
        # a CUDA graph's padded rows: "seqs" (decode: rows with context 0 are padding),
        # "tokens" (prefill: padded tokens write no K/V, slot -1), False (eager: none)
        self.graph_rows: str | bool = False
        self.packed = None          # flat fp32 of the small results (norms, routing, lens top-k)
        self.layout: dict[str, tuple[int, tuple]] = {}    # name -> (offset, shape) in packed

    def load_plan(self, plan: ProbePlan) -> None:
        """Point a CUDA graph's static buffers at this step's watched rows (one copy; the
        template's rows past the plan's point at row 0 and are ignored). graph_supports
        admitted the plan: it fits the template's R rows and one last row."""
        R = len(self.rows)
        # fresh pinned memory each step: the copy of the step before may not have run yet
        staging = torch.empty(R + 2, dtype=torch.int64, pin_memory=True)
        st = staging.numpy()
        n = len(plan.rows)
        st[:n] = plan.rows
        st[n:R] = 0
        st[R] = plan.last_rows[0] if plan.last_rows else 0
        st[R + 1] = plan.last_batch[0] if plan.last_batch else 0
        self.index.copy_(staging, non_blocking=True)

    @classmethod
    def for_step(cls, runner, inp) -> "ProbeBuffers":
        return cls.for_rows(runner, inp.probe_plan, len(inp.input_ids))

    @classmethod
    def for_rows(cls, runner, plan: ProbePlan, num_rows: int) -> "ProbeBuffers":
        cfg = runner.hf_config
        return cls(plan, num_rows, runner.num_layers, cfg.hidden_size, runner.device,
                   runner.dtype, getattr(runner.model, "moe_layers", []),
                   getattr(cfg, "num_experts", 0) or 0, getattr(cfg, "num_experts_per_tok", 0) or 0)

    # ---- hook points (called from the forward) -------------------------------------------------
    def sumsq_out(self, index: int) -> torch.Tensor | None:
        """Where the norm kernel at hook `index` stores sum(residual^2) per row, or None."""
        return self.sumsq[index] if self.sumsq is not None else None

    def on_resid(self, index: int, residual: torch.Tensor) -> None:
        """index 0 = hook_embed, index l + 1 = blocks.l.hook_resid_post. residual [N, H]."""
        if self.resid_at is not None and residual.shape[0] == self.num_rows:
            self.resid_at[index] = residual             # a reference: no launch (on_final)
        elif self.lens_resid is not None:
            torch.index_select(residual, 0, self.last_rows, out=self.lens_resid[index])

    def q_row_out(self, layer: int, num_heads: int, head_dim: int, dtype, device):
        """(watched rows [W], out [W, Hq, D]) for a kernel that writes the watched queries'
        rows itself as it produces q (no copy launch per layer), or None for this layer."""
        slot = self.attn_slot.get(layer)
        if slot is None:
            return None
        if self.q_rows is None:
            self.q_rows = torch.empty(len(self.attn_layers), len(self.last_rows), num_heads,
                                      head_dim, dtype=dtype, device=device)
        return self.last_rows, self.q_rows[slot]

    def on_attention(self, layer: int, q: torch.Tensor, k_cache: torch.Tensor, ctx,
                     q_written: bool = False) -> None:
        """q [N, Hq, D]; K of this step is already in the cache. `q_written`: the watched q
        rows are already in q_rows (the fused q/k-norm + RoPE + store kernel wrote them)."""
        slot = self.attn_slot.get(layer)
        if slot is not None:
            self.q_row_out(layer, *q.shape[1:], q.dtype, q.device)    # allocates q_rows once
            if self.attn_ctx is None:
                self.attn_ctx = ctx
                self.page_size = k_cache.shape[1]
            if not q_written:
                torch.index_select(q, 0, self.last_rows, out=self.q_rows[slot])
        for row_start, start_pos, m, b in self.plan.pattern_layers.get(layer, ()):
            # one prefill chunk of a watched prompt: its m queries over keys [0, start_pos + m),
            # read back from the paged cache (earlier chunks and prefix-cache hits included)
            n_keys = start_pos + m
            qs = q[row_start:row_start + m].float()                         # [m, Hq, D]
            bs = k_cache.shape[1]
            ids = ctx.block_tables[b, :(n_keys + bs - 1) // bs].long()
            k = k_cache[ids].reshape(-1, *k_cache.shape[2:])[:n_keys].float()   # [n_keys, Hkv, D]
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            s = torch.einsum("qhd,khd->hqk", qs, k) * q.shape[-1] ** -0.5
            qpos = torch.arange(start_pos, n_keys, device=q.device)[:, None]
            causal = torch.arange(n_keys, device=q.device)[None, :] <= qpos     # [m, n_keys]
            self.patterns[layer, row_start] = torch.softmax(
                s.masked_fill(~causal, float("-inf")), -1)                     # [Hq, m, n_keys]

    def route_out(self, layer: int, num_rows: int):
        """(probs, weights, ids) slices the router writes into, or None."""
        if not self.stacked or num_rows != self.num_rows:
            return None
        i = self.moe_index[layer]
        return self.probs_all[i], self.w_all[i], self.ids_all[i]

    def on_router(self, layer: int, probs, topk_ids, topk_w, shared_gate=None) -> None:
        """probs [N, E] fp32, topk_ids/topk_w [N, k], shared_gate [N] (sigmoid) or None."""
        i = self.moe_index[layer]
        if self.stacked:                # the router already wrote probs/ids/weights
            if shared_gate is not None:
                self.gate_all[i].copy_(shared_gate.reshape(-1))
                self.has_shared_gate = True
            return
        if self.router_probs is not None:
            torch.index_select(probs, 0, self.rows, out=self.router_probs[i])
            torch.index_select(topk_ids, 0, self.rows, out=self.router_ids[i])
            torch.index_select(topk_w, 0, self.rows, out=self.router_w[i])
            if shared_gate is not None:
                torch.index_select(shared_gate.reshape(-1).float(), 0, self.rows,
                                   out=self.shared_gate[i])
                self.has_shared_gate = True
        if self.expert_load is not None:
            ids = topk_ids.reshape(-1).long()
            self.expert_load[i].zero_().scatter_add_(0, ids, torch.ones_like(ids, dtype=torch.float32))

    def on_final(self, model) -> None:
        """After the forward: every reduction over the layers, then pack for the host."""
        parts: dict[str, torch.Tensor] = {}
        if self.sumsq is not None:
            self.norms = self.sumsq.index_select(1, self.rows).sqrt()          # [L + 1, R]
            parts["norms"] = self.norms
        if self.stacked:
            self._reduce_stacked()
        if self.router_probs is not None:
            parts.update(router_probs=self.router_probs, router_ids=self.router_ids,
                         router_w=self.router_w)
            if self.has_shared_gate:
                parts["shared_gate"] = self.shared_gate
        if self.expert_load is not None:
            parts["expert_load"] = self.expert_load
        if self.resid_at:
            idx = sorted(self.resid_at)
            rows = torch.stack([self.resid_at[i] for i in idx]).index_select(1, self.last_rows)
            if len(idx) == self.lens_resid.shape[0]:
                self.lens_resid.copy_(rows)
            else:                   # a hook that saw other rows copied its own already
                self.lens_resid[idx] = rows
            self.resid_at.clear()   # a graph's warm-up forward runs before its capture
        if self.lens_resid is not None:
            L1, W, H = self.lens_resid.shape
            x = model.model.norm(self.lens_resid[1:].reshape(-1, H))
            logits = model.compute_logits(x)                    # [L * W, V]
            k = self.plan.lens_top_k
            st = (lens_stats if logits.is_cuda else lens_stats_ref)(logits, k)
            # the sampled token's probability and rank wait for sampling (finish)
            self.lens_out = dict(logits=logits.view(L1 - 1, W, -1), lse=st["lse"].view(L1 - 1, W))
            parts.update(lens_top_i=st["top_i"].view(L1 - 1, W, k),
                         lens_top_p=st["top_p"].view(L1 - 1, W, k),
                         lens_entropy=st["entropy"].view(L1 - 1, W))
        tp = model.lm_head.tp
        if self.q_rows is not None:
            self._attention_all_layers(model, tp)
        for key in list(self.patterns):
            self.patterns[key] = tp.all_gather_dim(self.patterns[key], 0)
        self.layout, off = {}, 0
        for name, t in parts.items():
            self.layout[name] = (off, tuple(t.shape))
            off += t.numel()
        self.packed = (torch.cat([t.reshape(-1).float() for t in parts.values()])
                       if parts else None)

    def _reduce_stacked(self) -> None:
        m, N, k = self.ids_all.shape
        if self.record_routing:
            self.router_probs = self.probs_all.index_select(1, self.rows)     # [m, R, E]
            self.router_ids = self.ids_all.index_select(1, self.rows)
            self.router_w = self.w_all.index_select(1, self.rows)
            self.shared_gate = self.gate_all.index_select(1, self.rows)
        if self.record_load:
            E = self.num_experts
            ids = (self.ids_all.long() + torch.arange(m, device=self.ids_all.device)[:, None, None] * E)
            if self.graph_rows == "tokens":     # a prefill bucket's padded tokens: slot -1
                valid = (get_context().slot_mapping[:N] >= 0).float()
                w = valid[None, :, None].expand(m, N, k)
            elif self.graph_rows:       # padding rows of a graph bucket route garbage: weight 0
                valid = (get_context().context_lens[:N] > 0).float()
                w = valid[None, :, None].expand(m, N, k)
            else:
                w = torch.ones(m, N, k, device=ids.device)
            self.expert_load = torch.zeros(m * E, device=ids.device).scatter_add_(
                0, ids.reshape(-1), w.reshape(-1)).view(m, E)

    def _attention_all_layers(self, model, tp) -> None:
        """One launch pair per watched query over every captured layer's K cache."""
        ctx = self.attn_ctx
        q_rows = self.q_rows
        k_all = model.k_cache_all
        max_ctx = ctx.block_tables.shape[1] * self.page_size
        fn = (attention_probe.attention_probs_layers if q_rows.is_cuda
              else attention_probe.attention_probs_layers_ref)
        scale = q_rows.shape[-1] ** -0.5
        outs = []
        for w in range(q_rows.shape[1]):
            b = self.last_batch[w:w + 1]     # index_select: a 0-d index would sync
            out = torch.empty(len(self.attn_layers), q_rows.shape[2], max_ctx,
                              dtype=torch.float32, device=q_rows.device)
            # a verify's row j sees its context up to its own position, not the drafts after it
            n = (self.last_ctx[w:w + 1] if self.last_ctx is not None
                 else ctx.context_lens.index_select(0, b))
            fn(q_rows[:, w], k_all, self.attn_layer_ids, ctx.block_tables.index_select(0, b)[0],
               n, scale, out)
            outs.append(out)
        self.attn_probs = tp.all_gather_dim(torch.stack(outs, 1), 2)   # [A, W, Hq, max_ctx]

    # ---- after sampling (rank 0) ----------------------------------------------------------------
    def finish(self, sampled: torch.Tensor | None, plan: ProbePlan, sample_index: list[int],
               block_size: int):
        """Queue everything the host will read about this step, right after sampling (the lens'
        rank of the sampled token included). Nothing here waits for the device, and nothing the
        result holds is a buffer the next step (or graph replay) overwrites."""
        from .result import ProbeResult, queue_attention_rows
        named: list[tuple[str, torch.Tensor]] = []
        if self.packed is not None:
            named.append(("packed", self.packed))
        lo = self.lens_out
        if lo is not None and sampled is not None and len(sample_index):
            t = _rows_of(sampled, sample_index)                             # [W]
            stats = sampled_stats if t.is_cuda else sampled_stats_ref
            prob, rank = stats(lo["logits"], lo["lse"], t)                  # [L, W] each
            named.append(("lens_sampled_prob", prob))
            named.append(("lens_sampled_rank", rank))
        for (layer, start), t in self.patterns.items():
            named.append((f"pat{layer}_{start}", t))
        # the step's plan, not self.plan: a CUDA graph's buffers keep the template they were
        # captured with, and only the step's plan says which requests asked for which layers
        attention = queue_attention_rows(self, plan, block_size)
        return ProbeResult.start(named, self.layout, attention, self.has_shared_gate)


def _to_device(t: torch.Tensor, device) -> torch.Tensor:
    """A small host tensor to the device without waiting for the device's queued work (a
    pageable copy would): staged in pinned memory, copied asynchronously."""
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def _rows_of(x: torch.Tensor, index: list[int]) -> torch.Tensor:
    """x[index] without a synchronous host->device copy of the index: a slice when the rows
    are consecutive (one watched request: always), else the index staged in pinned memory.
    (torch.tensor(index, device="cuda") waits for the device to drain the queued step: it
    cost a watched batch-1 step ~1.2 ms, more than the step itself.)"""
    a = index[0]
    if list(index) == list(range(a, a + len(index))):
        return x[a:a + len(index)]
    t = torch.tensor(index, dtype=torch.int64)
    if x.is_cuda:
        t = t.pin_memory().to(x.device, non_blocking=True)
    return x.index_select(0, t)


# ---- CUDA-graph variants -----------------------------------------------------------------------
GRAPH_LENS_TOP_K = 10


def graph_variant(plan: ProbePlan | None) -> tuple[bool, bool] | None:
    """Which probe-capturing graph a step needs: None (probes off) or (lens, attention).
    Norms, routing and expert load are in every variant: they cost no launch per layer."""
    if plan is None:
        return None
    return bool(plan.lens and len(plan.last_rows)), bool(plan.attention_layers)


def _template_plan(runner, variant: tuple[bool, bool], num_rows: int = 1) -> ProbePlan:
    lens, attention = variant
    moe = bool(getattr(runner.model, "moe_layers", []))
    return ProbePlan(entries=[], rows=list(range(num_rows)), last_rows=[0], last_batch=[0],
                     norms=True, lens=lens, lens_top_k=GRAPH_LENS_TOP_K,
                     attention_layers=list(range(runner.num_layers)) if attention else [],
                     routing=moe, expert_load=moe)


def graph_probe_buffers(runner, batch: int, variant: tuple[bool, bool],
                        prefill: bool = False) -> ProbeBuffers:
    """Static probe buffers captured into the graph of one bucket: one watched request, the
    probes of `variant` on (the host keeps only what its ProbeSpec asked for). Decode: one
    row per watched request; prefill (`batch` = the token bucket): up to every token."""
    bufs = ProbeBuffers.for_rows(runner, _template_plan(runner, variant, batch if prefill else 1),
                                 batch)
    bufs.graph_rows = "tokens" if prefill else "seqs"
    return bufs


def graph_supports(plan: ProbePlan, runner) -> bool:
    """A decode step whose probes fit a captured template: at most one watched request
    (none when only the global expert load is recorded)."""
    return prefill_graph_supports(plan, runner, 1)


def prefill_graph_supports(plan: ProbePlan, runner, num_tokens: int) -> bool:
    """A prefill step whose probes fit a prefill bucket's template: at most one watched
    request (its rows and its last row), no prompt patterns, and on an MoE model a bucket
    whose routing the router writes straight into the stacked buffers."""
    if plan is None:
        return True
    if len(plan.entries) > 1 or plan.pattern_layers or plan.lens_top_k > GRAPH_LENS_TOP_K:
        return False
    if len(plan.last_rows) > 1 or len(plan.rows) > num_tokens:
        return False
    return num_tokens <= STACK_ROUTING_ROWS or not getattr(runner.model, "moe_layers", [])
