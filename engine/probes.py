"""Introspection probes: the engine's own computation, recorded cheaply.

ProbeManager (rank 0, host) decides each step which flat rows are watched (a ProbePlan) and
turns the device buffers into RequestTraces afterwards. ProbeBuffers (every rank, device) is
what the forward writes into at the hook points: residual norms at each fused add, the
residual rows of the token being predicted (for the logit lens), the watched query's attention
row rebuilt from the paged K cache, and MoE routing. Nothing here runs when no request is
watched: the context's `probes` is None and every hook is skipped.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch

from .kernels import attention_probe
from .trace import AttentionStep, LensStep, RequestTrace


@dataclass
class WatchedEntry:
    request_id: str
    batch_index: int            # row of the block tables / context lens
    row_start: int              # first flat token row of this entry
    num_tokens: int
    start_pos: int
    samples: bool
    spec: object                # ProbeSpec
    block_table: list = field(default_factory=list)   # at plan time (freed blocks vanish later)


@dataclass
class ProbePlan:
    """Host-side description of what to record this step (sent to every rank)."""
    entries: list[WatchedEntry]
    rows: torch.Tensor              # [R] flat rows of all watched tokens (norms, routing)
    last_rows: torch.Tensor         # [W] flat rows of watched entries that sample (lens, attention)
    last_batch: torch.Tensor        # [W] their batch indices
    norms: bool
    lens: bool
    lens_top_k: int
    attention_layers: list[int]
    routing: bool
    expert_load: bool
    # layer -> [(row_start, n)]: one full prompt pattern per watched prefill that asks for it
    pattern_layers: dict = field(default_factory=dict)
    sampling_rows: list = field(default_factory=list)     # flat rows sampled this step, in order


class ProbeBuffers:
    """Device-side outputs of one step's probes on one rank."""

    def __init__(self, plan: ProbePlan, num_layers: int, hidden: int, device, dtype,
                 moe_layers: list[int], num_experts: int, top_k: int):
        self.plan = plan
        self.device = device
        R, W = len(plan.rows), len(plan.last_rows)
        self.rows = plan.rows.to(device)
        self.last_rows = plan.last_rows.to(device)
        self.last_batch = plan.last_batch.to(device)
        self.norms = torch.zeros(num_layers + 1, R, device=device) if plan.norms and R else None
        self.lens_resid = (torch.zeros(num_layers + 1, W, hidden, device=device, dtype=dtype)
                           if plan.lens and W else None)
        self.attn: dict[int, torch.Tensor] = {}
        self.patterns: dict[tuple[int, int], torch.Tensor] = {}   # (layer, row_start) -> [Hq, n, n]
        self.moe_index = {layer: i for i, layer in enumerate(moe_layers)}
        m = len(moe_layers)
        rec = plan.routing and R and m
        self.router_probs = torch.zeros(m, R, num_experts, device=device) if rec else None
        self.router_ids = torch.zeros(m, R, top_k, device=device) if rec else None
        self.router_w = torch.zeros(m, R, top_k, device=device) if rec else None
        self.shared_gate = torch.zeros(m, R, device=device) if rec else None
        self.has_shared_gate = False
        self.expert_load = (torch.zeros(m, num_experts, device=device)
                            if plan.expert_load and m else None)
        self.lens_out = None
        self.row_valid = None       # [N] 1/0 per flat row (CUDA-graph padding rows are 0)

    def load_plan(self, plan: ProbePlan, num_valid_rows: int) -> None:
        """Point a CUDA graph's static buffers at this step's watched rows."""
        # the template records one row; a plan that needs none points it at row 0, and the
        # host then ignores what was recorded there
        def one(t: torch.Tensor) -> torch.Tensor:
            return t if len(t) == 1 else torch.zeros(1, dtype=torch.int64)
        self.plan_host = plan
        self.rows.copy_(one(plan.rows), non_blocking=True)
        self.last_rows.copy_(one(plan.last_rows), non_blocking=True)
        self.last_batch.copy_(one(plan.last_batch), non_blocking=True)
        if self.row_valid is not None:
            self.row_valid.zero_()
            self.row_valid[:num_valid_rows] = 1.0

    @classmethod
    def for_step(cls, runner, inp) -> "ProbeBuffers":
        cfg = runner.hf_config
        moe_layers = getattr(runner.model, "moe_layers", [])
        return cls(inp.probe_plan, runner.num_layers, cfg.hidden_size, runner.device,
                   runner.dtype, moe_layers, getattr(cfg, "num_experts", 0) or 0,
                   getattr(cfg, "num_experts_per_tok", 0) or 0)

    # ---- hook points (called from the forward) -------------------------------------------------
    def on_resid(self, index: int, residual: torch.Tensor) -> None:
        """index 0 = hook_embed, index l + 1 = blocks.l.hook_resid_post. residual [N, H]."""
        if self.norms is not None:
            self.norms[index] = residual.index_select(0, self.rows).float().norm(dim=-1)
        if self.lens_resid is not None:
            self.lens_resid[index] = residual.index_select(0, self.last_rows)

    def on_attention(self, layer: int, q: torch.Tensor, k_cache: torch.Tensor, ctx) -> None:
        """q [N, Hq, D]; K of this step is already in the cache."""
        plan = self.plan
        scale = q.shape[-1] ** -0.5
        if layer in plan.attention_layers and len(plan.last_rows):
            fn = attention_probe.attention_probs if q.is_cuda else attention_probe.attention_probs_ref
            max_ctx = ctx.block_tables.shape[1] * k_cache.shape[1]
            outs = []
            for w in range(len(plan.last_rows)):
                # index_select, not t[tensor]: a 0-d tensor index would sync (and break capture)
                row = self.last_rows[w:w + 1]
                b = self.last_batch[w:w + 1]
                out = torch.empty(q.shape[1], max_ctx, dtype=torch.float32, device=q.device)
                fn(q.index_select(0, row)[0], k_cache, ctx.block_tables.index_select(0, b)[0],
                   ctx.context_lens.index_select(0, b), scale, out)
                outs.append(out)
            self.attn[layer] = torch.stack(outs)            # [W, Hq_local, max_ctx]
        for start, n in plan.pattern_layers.get(layer, ()):
            qs = q[start:start + n].float()                 # [n, Hq, D]
            b = [e.batch_index for e in plan.entries if e.row_start == start][0]
            bs = k_cache.shape[1]
            ids = ctx.block_tables[b, :(n + bs - 1) // bs].long()
            k = k_cache[ids].reshape(-1, *k_cache.shape[2:])[:n].float()   # [n, Hkv, D]
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            s = torch.einsum("qhd,khd->hqk", qs, k) * scale
            causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
            self.patterns[layer, start] = torch.softmax(s.masked_fill(~causal, float("-inf")), -1)

    def on_router(self, layer: int, probs, topk_ids, topk_w, shared_gate=None) -> None:
        """probs [N, E] fp32, topk_ids/topk_w [N, k], shared_gate [N] (sigmoid) or None."""
        i = self.moe_index[layer]
        if self.router_probs is not None:
            self.router_probs[i] = probs.index_select(0, self.rows).float()
            self.router_ids[i] = topk_ids.index_select(0, self.rows).float()
            self.router_w[i] = topk_w.index_select(0, self.rows).float()
            if shared_gate is not None:
                self.shared_gate[i] = shared_gate.reshape(-1).index_select(0, self.rows).float()
                self.has_shared_gate = True
        if self.expert_load is not None:
            ids = topk_ids.reshape(-1).long()
            ones = (self.row_valid[:, None].expand(topk_ids.shape).reshape(-1)
                    if self.row_valid is not None else torch.ones_like(ids, dtype=torch.float32))
            self.expert_load[i].zero_().scatter_add_(0, ids, ones)

    def on_final(self, model) -> None:
        """After the forward: logit lens on every layer's residual; gather TP-split heads."""
        if self.lens_resid is not None:
            L1, W, H = self.lens_resid.shape
            x = model.model.norm(self.lens_resid[1:].reshape(-1, H))
            logits = model.compute_logits(x).float()            # [L * W, V]
            probs = torch.softmax(logits, dim=-1)
            k = self.plan.lens_top_k
            top_p, top_i = probs.topk(k, dim=-1)
            ent = -(probs * torch.log(probs.clamp_min(1e-30))).sum(-1)
            self.lens_out = dict(probs=probs.view(L1 - 1, W, -1), top_p=top_p.view(L1 - 1, W, k),
                                 top_i=top_i.view(L1 - 1, W, k), entropy=ent.view(L1 - 1, W))
        tp = model.lm_head.tp
        for layer in list(self.attn):
            self.attn[layer] = tp.all_gather_dim(self.attn[layer], 1)
        for key in list(self.patterns):
            self.patterns[key] = tp.all_gather_dim(self.patterns[key], 0)


class ProbeManager:
    """Rank 0's side: plans what to record, and folds the recorded buffers into traces."""

    def __init__(self, llm, max_traces: int = 64):
        self.llm = llm
        self.traces: OrderedDict[str, RequestTrace] = OrderedDict()
        self.max_traces = max_traces
        self.record_expert_load = False      # global aggregate (the UI turns it on)
        self._specs: dict[str, object] = {}
        self._active: set[str] = set()         # watched requests not yet finished

    @property
    def moe_layers(self) -> list[int]:
        return list(getattr(self.llm.runner, "moe_layers", []))

    def register(self, seq) -> None:
        if seq.watch is None or not seq.watch.any:
            return
        tr = RequestTrace(seq.request_id, self.llm.hf_config.num_hidden_layers,
                          prompt_token_ids=list(seq.prompt_token_ids), moe_layers=self.moe_layers)
        tr.token_texts = [self._text(t) for t in seq.prompt_token_ids]
        self.traces[seq.request_id] = tr
        self._specs[seq.request_id] = seq.watch
        self._active.add(seq.request_id)
        while len(self.traces) > self.max_traces:
            old, _ = self.traces.popitem(last=False)
            self._specs.pop(old, None)

    def _text(self, tok: int) -> str:
        tk = self.llm.tokenizer
        return tk.decode([tok]) if tk is not None else str(tok)

    def plan(self, scheduled) -> ProbePlan | None:
        self.llm.runner._expert_load = None     # this step's load only; none when not recorded
        if not self._active and not (self.record_expert_load and self.moe_layers):
            return None                         # off means off: no per-step walk of the batch
        entries, row, sampling_rows = [], 0, []
        for b, s in enumerate(scheduled):
            if s.samples:
                sampling_rows.append(row + s.num_tokens - 1)
            spec = s.seq.watch
            if spec is not None and spec.any and s.seq.request_id in self.traces:
                entries.append(WatchedEntry(s.seq.request_id, b, row, s.num_tokens, s.start,
                                            s.samples, spec, list(s.seq.block_table)))
            row += s.num_tokens
        moe = bool(self.moe_layers)
        if not entries and not (self.record_expert_load and moe):
            return None
        rows = [r for e in entries if e.spec.norms or e.spec.routing
                for r in range(e.row_start, e.row_start + e.num_tokens)]
        last = [e for e in entries if e.samples and (e.spec.logit_lens or e.spec.attention)]
        L = self.llm.hf_config.num_hidden_layers
        att = sorted({l for e in last if e.spec.attention
                      for l in (e.spec.layers if e.spec.layers is not None else range(L))})
        patterns = {}
        for e in entries:
            if e.start_pos == 0 and e.samples and e.num_tokens <= e.spec.prefill_pattern_cap:
                for l in e.spec.prefill_pattern_layers:
                    patterns.setdefault(l, []).append((e.row_start, e.num_tokens))
        return ProbePlan(
            entries=entries, rows=torch.tensor(rows, dtype=torch.int64),
            last_rows=torch.tensor([e.row_start + e.num_tokens - 1 for e in last], dtype=torch.int64),
            last_batch=torch.tensor([e.batch_index for e in last], dtype=torch.int64),
            norms=any(e.spec.norms for e in entries),
            lens=any(e.spec.logit_lens for e in last),
            lens_top_k=max([e.spec.lens_top_k for e in entries] or [1]),
            attention_layers=att, routing=moe and any(e.spec.routing for e in entries),
            expert_load=moe, pattern_layers=patterns, sampling_rows=sampling_rows)

    def after_sample(self, plan: ProbePlan, bufs: ProbeBuffers, tokens: torch.Tensor | None) -> None:
        """Rank and probability of the finally sampled token under each layer's lens."""
        if bufs is None or bufs.lens_out is None or tokens is None or not len(plan.last_rows):
            return
        sample_index = self._sample_index(plan)
        lo = bufs.lens_out
        t = tokens[torch.tensor(sample_index, device=tokens.device)]      # [W]
        p = lo["probs"].gather(-1, t[None, :, None].expand(lo["probs"].shape[0], -1, 1))[..., 0]
        lo["sampled_prob"] = p                                          # [L, W]
        lo["sampled_rank"] = (lo["probs"] > p[..., None]).sum(-1)

    def _sample_index(self, plan: ProbePlan) -> list[int]:
        """Index among the step's sampled rows of each watched sampling entry."""
        return [plan.sampling_rows.index(r) for r in plan.last_rows.tolist()]

    def collect(self, plan: ProbePlan, bufs: ProbeBuffers, scheduled, tokens: list[int]) -> None:
        if bufs is None:
            return
        # one device->host transfer: pack what this plan asked for into one flat fp32 tensor
        # (a CUDA graph's template records more; only the plan's part crosses to the host)
        named = []
        if plan.norms and len(plan.rows):
            named.append(("norms", bufs.norms))
        if plan.routing and len(plan.rows):
            for name in ("router_probs", "router_ids", "router_w", "shared_gate"):
                if getattr(bufs, name) is not None:
                    named.append((name, getattr(bufs, name)))
        if plan.expert_load and bufs.expert_load is not None:
            named.append(("expert_load", bufs.expert_load))
        if plan.lens and len(plan.last_rows) and bufs.lens_out is not None:
            for k in ("top_i", "top_p", "entropy", "sampled_prob", "sampled_rank"):
                if k in bufs.lens_out:
                    named.append(("lens_" + k, bufs.lens_out[k]))
        if plan.attention_layers and len(plan.last_rows):
            ctx = max(e.start_pos + e.num_tokens for e in plan.entries if e.samples)
            for l in plan.attention_layers:
                if l in bufs.attn:
                    named.append((f"attn{l}", bufs.attn[l][..., :ctx]))
        for (l, start), t in bufs.patterns.items():
            named.append((f"pat{l}_{start}", t))
        if not named:
            return
        flat = torch.cat([t.reshape(-1).float() for _, t in named]).cpu().numpy()
        host, off = {}, 0
        for name, t in named:
            host[name] = flat[off:off + t.numel()].reshape(t.shape)
            off += t.numel()
        if "expert_load" in host:
            self.llm.runner._expert_load = host["expert_load"]
        self._fold(plan, host, bufs, scheduled, tokens)

    def _fold(self, plan, host, bufs, scheduled, tokens) -> None:
        r0, w = 0, 0
        sample_index = self._sample_index(plan)
        for e in plan.entries:
            tr = self.traces.get(e.request_id)
            seq = scheduled[e.batch_index].seq
            nrows = e.num_tokens if (e.spec.norms or e.spec.routing) else 0
            for j in range(nrows):
                pos = e.start_pos + j
                if "norms" in host and e.spec.norms:
                    _put(tr.resid_norms, pos, host["norms"][:, r0 + j].copy())
                if "router_probs" in host and e.spec.routing:
                    _put(tr.router_probs, pos, host["router_probs"][:, r0 + j].copy())
                    _put(tr.router_topk_ids, pos, host["router_ids"][:, r0 + j].astype(np.int64))
                    _put(tr.router_topk_weights, pos, host["router_w"][:, r0 + j].copy())
                    if bufs.has_shared_gate:
                        _put(tr.shared_expert_gate, pos, host["shared_gate"][:, r0 + j].copy())
            r0 += nrows
            if e.samples and (e.spec.logit_lens or e.spec.attention):
                pos = e.start_pos + e.num_tokens - 1
                tok = tokens[sample_index[w]]
                if "lens_top_i" in host and e.spec.logit_lens:
                    k = e.spec.lens_top_k
                    tr.lens.append(LensStep(
                        pos, tok, host["lens_top_i"][:, w, :k].astype(np.int64),
                        host["lens_top_p"][:, w, :k].copy(),
                        host["lens_sampled_rank"][:, w].astype(np.int64),
                        host["lens_sampled_prob"][:, w].copy(), host["lens_entropy"][:, w].copy()))
                if e.spec.attention and plan.attention_layers:
                    layers = [l for l in plan.attention_layers
                              if e.spec.layers is None or l in e.spec.layers]
                    probs = np.stack([host[f"attn{l}"][w, :, :pos + 1] for l in layers])
                    bs = self.llm.block_size
                    tr.attention.append(AttentionStep(pos, layers, probs,
                                                      e.block_table[:pos // bs + 1], bs))
                w += 1
            for l in plan.pattern_layers:
                if f"pat{l}_{e.row_start}" in host:
                    tr.prefill_pattern[l] = host[f"pat{l}_{e.row_start}"].copy()
            if tr is not None:
                known = len(tr.token_texts)
                tr.token_texts.extend(self._text(t) for t in seq.token_ids[known:])
                tr.output_token_ids = list(seq.output_token_ids)

    def finish_request(self, seq) -> None:
        self._active.discard(seq.request_id)
        tr = self.traces.get(seq.request_id)
        if tr is not None:
            tr.output_token_ids = list(seq.output_token_ids)
            known = len(tr.token_texts)
            tr.token_texts.extend(self._text(t) for t in seq.token_ids[known:])
            tr.finished = True


def _put(lst: list, pos: int, value) -> None:
    """Store by position: a recomputed token (after preemption) overwrites its old row."""
    if pos < len(lst):
        lst[pos] = value
    else:
        # positions this request never computed (prefix-cache hits) are unknown: NaN, or -1
        # for ids; never a copy of another token's row
        value = np.asarray(value)
        unknown = np.nan if np.issubdtype(value.dtype, np.floating) else -1
        while len(lst) < pos:
            lst.append(np.full_like(value, unknown))
        lst.append(value)


# ---- CUDA-graph variants -----------------------------------------------------------------------
GRAPH_LENS_TOP_K = 10


def _template_plan(runner) -> ProbePlan:
    moe = bool(getattr(runner.model, "moe_layers", []))
    one = torch.zeros(1, dtype=torch.int64)
    return ProbePlan(entries=[], rows=one, last_rows=one.clone(), last_batch=one.clone(),
                     norms=True, lens=True, lens_top_k=GRAPH_LENS_TOP_K,
                     attention_layers=list(range(runner.num_layers)), routing=moe,
                     expert_load=moe)


def graph_probe_buffers(runner, batch: int) -> ProbeBuffers:
    """Static probe buffers captured into the decode graph of one bucket: one watched
    request, every probe on (the host keeps only what its ProbeSpec asked for)."""
    cfg = runner.hf_config
    bufs = ProbeBuffers(_template_plan(runner), runner.num_layers, cfg.hidden_size,
                        runner.device, runner.dtype, getattr(runner.model, "moe_layers", []),
                        getattr(cfg, "num_experts", 0) or 0,
                        getattr(cfg, "num_experts_per_tok", 0) or 0)
    bufs.row_valid = torch.zeros(batch, device=runner.device)
    return bufs


def graph_supports(plan: ProbePlan, runner) -> bool:
    """A decode step whose probes fit the captured template: at most one watched request
    (none when only the global expert load is recorded)."""
    if plan is None:
        return True
    if len(plan.entries) > 1 or plan.pattern_layers or plan.lens_top_k > GRAPH_LENS_TOP_K:
        return False
    return len(plan.rows) <= 1 and len(plan.last_rows) <= 1
