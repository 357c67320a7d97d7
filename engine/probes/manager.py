"""Introspection probes, the host side: the engine's own computation, recorded cheaply.

ProbeManager (rank 0) decides each step which flat rows are watched (a ProbePlan, plan.py)
and folds what the forward recorded into RequestTraces afterwards. The device side — buffers the
forward writes into, the graph variants — is buffers.py. Nothing here runs when no
request is watched: the plan is None, the context's `probes` is None, every hook is skipped.
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch

from .buffers import ProbeBuffers
from .plan import ProbePlan, WatchedEntry
from .trace import AttentionStep, LensStep, RequestTrace


class ProbeManager:
    """Rank 0's side: plans what to record, and folds the recorded buffers into traces."""

    def __init__(self, llm, max_traces: int = 64):
        self.llm = llm
        self.traces: OrderedDict[str, RequestTrace] = OrderedDict()
        self.max_traces = max_traces
        self._evicted: set[str] = set()         # ids whose traces were dropped (bounded below)
        self.record_expert_load = False      # global aggregate (the UI turns it on)
        self._specs: dict[str, object] = {}
        self._active: set[str] = set()         # watched requests not yet finished
        self._moe_layers: list[int] | None = None
        self.num_layers = llm.hf_config.num_hidden_layers
        # attention rows (layers x heads x context, fp32: ~0.5 MB a token at 0.6B shapes and
        # 300 tokens) stay on the device, one copy launch per step, and cross to the host when
        # the trace is read; past this many bytes pending, they are moved during the step
        self.max_pending_bytes = 256 << 20
        self._pending: dict[str, list[AttentionStep]] = {}
        self._pending_bytes = 0

    @property
    def moe_layers(self) -> list[int]:
        if self._moe_layers is None:
            self._moe_layers = list(getattr(self.llm.runner, "moe_layers", []))
        return self._moe_layers

    def register(self, seq) -> None:
        if seq.watch is None or not seq.watch.any:
            return
        tr = RequestTrace(seq.request_id, self.llm.hf_config.num_hidden_layers,
                          prompt_token_ids=list(seq.prompt_token_ids), moe_layers=self.moe_layers)
        self.traces[seq.request_id] = tr
        self._specs[seq.request_id] = seq.watch
        self._active.add(seq.request_id)
        while len(self.traces) > self.max_traces:
            old, _ = self.traces.popitem(last=False)
            self._evicted.add(old)
            if len(self._evicted) > 100_000:
                self._evicted.clear()
            for st in self._pending.pop(old, []):
                self._pending_bytes -= st.probs.numel() * 4
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
        L = self.num_layers
        att = sorted({l for e in last if e.spec.attention
                      for l in (e.spec.layers if e.spec.layers is not None else range(L))})
        patterns = {}
        for e in entries:
            if e.start_pos == 0 and e.samples and e.num_tokens <= e.spec.prefill_pattern_cap:
                for l in e.spec.prefill_pattern_layers:
                    patterns.setdefault(l, []).append((e.row_start, e.num_tokens))
        return ProbePlan(
            entries=entries, rows=rows,
            last_rows=[e.row_start + e.num_tokens - 1 for e in last],
            last_batch=[e.batch_index for e in last],
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
        return [plan.sampling_rows.index(r) for r in plan.last_rows]

    def collect(self, plan: ProbePlan, bufs: ProbeBuffers, scheduled, tokens: list[int]) -> None:
        if bufs is None:
            return
        # the packed results (norms, routing, expert load, lens top-k) crossed in the step's
        # one non-blocking copy; only lens ranks and prefill patterns, which exist for watched
        # requests that ask for them, take a second one
        host = dict(bufs.host())
        named = []
        if plan.lens and len(plan.last_rows) and bufs.lens_out is not None:
            for k in ("sampled_prob", "sampled_rank"):
                if k in bufs.lens_out:
                    named.append(("lens_" + k, bufs.lens_out[k]))
        for (l, start), t in bufs.patterns.items():
            named.append((f"pat{l}_{start}", t))
        if named:
            flat = torch.cat([t.reshape(-1).float() for _, t in named]).cpu().numpy()
            off = 0
            for name, t in named:
                host[name] = flat[off:off + t.numel()].reshape(t.shape)
                off += t.numel()
        if not host and bufs.attn_probs is None:
            return
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
                if e.spec.attention and plan.attention_layers and bufs.attn_probs is not None:
                    layers = [l for l in plan.attention_layers
                              if e.spec.layers is None or l in e.spec.layers]
                    slots = [bufs.attn_slot[l] for l in layers]
                    a = bufs.attn_probs                        # [A, W, Hq, max_ctx], device
                    if slots == list(range(a.shape[0])):
                        rows = a[:, w, :, :pos + 1].clone()    # [layers, Hq, pos + 1]
                    else:
                        rows = a[slots, w, :, :pos + 1]        # advanced indexing: a copy
                    bs = self.llm.block_size
                    self._defer_attention(tr, AttentionStep(pos, layers, rows,
                                                            e.block_table[:pos // bs + 1], bs))
                w += 1
            for l in plan.pattern_layers:
                if f"pat{l}_{e.row_start}" in host:
                    tr.prefill_pattern[l] = host[f"pat{l}_{e.row_start}"].copy()
            if tr is not None:      # new output ids only; texts are decoded when read
                out_ids = seq.token_ids[seq.num_prompt_tokens + len(tr.output_token_ids):]
                tr.output_token_ids.extend(out_ids)

    def finish_request(self, seq) -> None:
        self._active.discard(seq.request_id)
        tr = self.traces.get(seq.request_id)
        if tr is not None:
            tr.output_token_ids = list(seq.output_token_ids)
            tr.finished = True

    def _defer_attention(self, tr: RequestTrace, step: AttentionStep) -> None:
        self._pending.setdefault(tr.request_id, []).append(step)
        self._pending_bytes += step.probs.numel() * 4
        if self._pending_bytes > self.max_pending_bytes:
            for rid in list(self._pending):
                self._materialize(rid)

    def _materialize(self, request_id: str) -> None:
        """Move a request's pending attention rows to the host, in order, into its trace."""
        steps = self._pending.pop(request_id, [])
        tr = self.traces.get(request_id)
        for st in steps:
            self._pending_bytes -= st.probs.numel() * 4
            st.probs = st.probs.cpu().numpy()
            if tr is not None:
                tr.attention.append(st)

    def get(self, request_id: str) -> RequestTrace:
        """The trace, complete so far: attention rows still on the device come to the host,
        and every token gets its text (both done here, on read, so the engine step does no
        copies or tokenizer work for them)."""
        tr = self.traces.get(request_id)
        if tr is None:
            if request_id in self._evicted:
                raise KeyError(f"the trace of {request_id!r} was evicted: only the newest "
                               f"{self.max_traces} traces are kept (LLM(max_traces=...))")
            raise KeyError(f"no trace for {request_id!r}: it was never watched (pass watch="
                           "ProbeSpec() to stream/generate to record one)")
        if tr is not None:
            self._materialize(request_id)
            ids = tr.prompt_token_ids + tr.output_token_ids
            tr.token_texts.extend(self._text(t) for t in ids[len(tr.token_texts):])
        return tr


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
