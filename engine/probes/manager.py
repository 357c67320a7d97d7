"""ProbeManager, the probes' host side (rank 0): decides each step which flat rows are watched
(a ProbePlan) and folds what the forward recorded (a ProbeResult) into RequestTraces. With no
request watched the plan is None and every hook is skipped. It is handed plain facts (layer
count, block size, MoE layers, a token decoder), not the engine.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable

import numpy as np

from .attention_store import AttentionStore
from .plan import ProbePlan, WatchedEntry
from .result import ProbeResult
from .trace import AttentionStep, LensStep, RequestTrace


class ProbeManager:
    """Rank 0's side: plans what to record, and folds the recorded results into traces."""

    def __init__(self, num_layers: int, block_size: int, moe_layers: list[int],
                 decode: Callable[[list[int]], str] | None, max_traces: int = 64,
                 record_expert_load: bool = False):
        self.num_layers = num_layers
        self.block_size = block_size
        self.moe_layers = list(moe_layers)
        self.decode = decode
        self.traces: OrderedDict[str, RequestTrace] = OrderedDict()
        self.max_traces = max_traces
        self._evicted: set[str] = set()         # ids whose traces were dropped (bounded below)
        # a global aggregate over every request, watched or not: a public engine option
        self.record_expert_load = record_expert_load
        self._active: set[str] = set()          # watched requests not yet finished
        # attention rows stay on the device where the step left them; a reader moves the one
        # it shows, and the store moves the oldest to the host off the engine thread
        self.attention_store = AttentionStore()
        # request id -> (lens steps, attention rows) of a watched verify awaiting its verdict
        self._unsettled: dict[str, tuple[list, list]] = {}

    def register(self, seq) -> None:
        if seq.watch is None or not seq.watch.any:
            return
        tr = RequestTrace(seq.request_id, self.num_layers,
                          prompt_token_ids=list(seq.prompt_token_ids), moe_layers=self.moe_layers,
                          interventions=[iv.to_dict() for iv in seq.interventions])
        self.traces[seq.request_id] = tr
        self._active.add(seq.request_id)
        while len(self.traces) > self.max_traces:
            old, _ = self.traces.popitem(last=False)
            self._evicted.add(old)
            if len(self._evicted) > 100_000:
                self._evicted.clear()
            self.attention_store.forget(old)

    # ---- before the step: what to record ---------------------------------------------------------
    def plan(self, scheduled) -> ProbePlan | None:
        if not self._active and not (self.record_expert_load and self.moe_layers):
            return None                         # off means off: no per-step walk of the batch
        entries, row, sampling_rows = [], 0, []
        for b, s in enumerate(scheduled):
            if s.samples:       # a verify samples its last 1 + num_draft rows
                sampling_rows.extend(range(row + s.num_tokens - 1 - s.num_draft,
                                           row + s.num_tokens))
            spec = s.seq.watch
            if spec is not None and spec.any and s.seq.request_id in self._active:
                entries.append(WatchedEntry(s.seq.request_id, b, row, s.num_tokens, s.start,
                                            s.samples, spec, list(s.seq.block_table),
                                            1 + s.num_draft if s.samples else 1))
            row += s.num_tokens
        moe = bool(self.moe_layers)
        if not entries and not (self.record_expert_load and moe):
            return None
        rows = [r for e in entries if e.spec.norms or e.spec.routing
                for r in range(e.row_start, e.row_start + e.num_tokens)]
        last = [e for e in entries if e.records_last]
        L = self.num_layers
        att = sorted({l for e in last if e.spec.attention
                      for l in (e.spec.layers if e.spec.layers is not None else range(L))})
        patterns: dict[int, list] = {}
        for e in entries:
            prompt_len = len(self.traces[e.request_id].prompt_token_ids)
            # every chunk of the prompt (never the recompute of generated tokens after a
            # preemption), for prompts up to the cap
            if e.spec.prefill_pattern_layers and e.start_pos < prompt_len <= \
                    e.spec.prefill_pattern_cap:
                m = min(e.num_tokens, prompt_len - e.start_pos)
                for l in e.spec.prefill_pattern_layers:
                    patterns.setdefault(l, []).append((e.row_start, e.start_pos, m,
                                                       e.batch_index))
        # a watched verify records every sampled row (queries at successive positions)
        last_rows = [e.row_start + e.num_tokens - e.num_sampled + j
                     for e in last for j in range(e.num_sampled)]
        last_ctx = ([e.start_pos + e.num_tokens - e.num_sampled + j + 1
                     for e in last for j in range(e.num_sampled)]
                    if any(e.num_sampled > 1 for e in last) else [])
        return ProbePlan(
            entries=entries, rows=rows, last_rows=last_rows,
            last_batch=[e.batch_index for e in last for _ in range(e.num_sampled)],
            last_ctx=last_ctx,
            norms=any(e.spec.norms for e in entries),
            lens=any(e.spec.logit_lens for e in last),
            lens_top_k=max([e.spec.lens_top_k for e in entries] or [1]),
            attention_layers=att, routing=moe and any(e.spec.routing for e in entries),
            expert_load=moe, pattern_layers=patterns, sampling_rows=sampling_rows)

    @staticmethod
    def sample_index(plan: ProbePlan) -> list[int]:
        """Index among the step's sampled rows of each watched sampling entry (lens, attention)."""
        where = {r: i for i, r in enumerate(plan.sampling_rows)}
        return [where[r] for r in plan.last_rows]

    # ---- after the step: fold what was recorded --------------------------------------------------
    def fold(self, plan: ProbePlan, result: ProbeResult | None, seqs: list, tokens: list[int]):
        """Fold one postprocessed step into the traces. `seqs[i]` is the sequence of batch row
        i, `tokens` the step's sampled ids in sampling-row order. Returns the step's expert
        load [moe_layers, E] (or None)."""
        if result is None:
            return None
        host = result.host()
        sample_index = self.sample_index(plan)
        att: dict[int, list] = {}
        for q in result.attention:
            att.setdefault(q.entry_index, []).append(q)
        r0, w = 0, 0
        for i, e in enumerate(plan.entries):
            tr = self.traces.get(e.request_id)
            nrows = e.num_tokens if (e.spec.norms or e.spec.routing) else 0
            if tr is None:                      # evicted while in flight
                r0 += nrows
                w += e.num_sampled if e.records_last else 0
                continue
            if nrows:       # one strided copy per field and entry, then a view per token
                pos, cols = e.start_pos, slice(r0, r0 + nrows)
                if "norms" in host and e.spec.norms:
                    _put_rows(tr.resid_norms, pos, host["norms"][:, cols].T.copy())
                if "router_probs" in host and e.spec.routing:
                    _put_rows(tr.router_probs, pos,
                              host["router_probs"][:, cols].transpose(1, 0, 2).copy())
                    _put_rows(tr.router_topk_ids, pos,
                              host["router_ids"][:, cols].transpose(1, 0, 2).astype(np.int64))
                    _put_rows(tr.router_topk_weights, pos,
                              host["router_w"][:, cols].transpose(1, 0, 2).copy())
                    if result.has_shared_gate:
                        _put_rows(tr.shared_expert_gate, pos, host["shared_gate"][:, cols].T.copy())
            r0 += nrows
            if e.records_last:
                # one lens step (and attention row) per sampled row; a verify's wait for its
                # verdict (settle), which keeps those of the tokens it accepted
                lens, rows = [], []
                for j in range(e.num_sampled):
                    pos = e.start_pos + e.num_tokens - e.num_sampled + j
                    tok = tokens[sample_index[w]]
                    if "lens_top_i" in host and e.spec.logit_lens:
                        k = e.spec.lens_top_k
                        lens.append(LensStep(
                            pos, tok, host["lens_top_i"][:, w, :k].astype(np.int64),
                            host["lens_top_p"][:, w, :k].copy(),
                            host["lens_sampled_rank"][:, w].astype(np.int64),
                            host["lens_sampled_prob"][:, w].copy(),
                            host["lens_entropy"][:, w].copy()))
                    w += 1
                for q in att.get(i, ()):
                    rows.append(AttentionStep(q.position, q.layers, q.probs, q.block_table,
                                              self.block_size))
                if e.num_sampled > 1:
                    if e.request_id in self._active:
                        self._unsettled[e.request_id] = (lens, rows)
                else:
                    tr.lens.extend(lens)
                    for st in rows:
                        self._add_attention(tr, st)
            self._fold_patterns(plan, host, e, tr)
            seq = seqs[e.batch_index]
            resolved = seq.num_resolved_tokens
            if seq.spec is not None and seq.spec.drafts:    # drafts in flight are not output
                resolved = min(resolved, seq.spec.position)
            tr.output_token_ids.extend(       # new output ids only; texts are decoded when read
                seq.token_ids[seq.num_prompt_tokens + len(tr.output_token_ids):resolved])
        return host.get("expert_load")

    def _fold_patterns(self, plan: ProbePlan, host: dict, e: WatchedEntry,
                       tr: RequestTrace) -> None:
        """Rows of the prompt's full attention pattern computed by this chunk; positions served
        by the prefix cache are never computed and stay marked as such."""
        P = len(tr.prompt_token_ids)
        if tr.patterns_shared and any(f"pat{l}_{e.row_start}" in host for l in plan.pattern_layers):
            # a reader holds these arrays (RequestTrace.frozen): write into copies
            tr.prefill_pattern = {l: p.copy() for l, p in tr.prefill_pattern.items()}
            if tr.prefill_computed is not None:
                tr.prefill_computed = tr.prefill_computed.copy()
            tr.patterns_shared = False
        for layer, chunks in plan.pattern_layers.items():
            key = f"pat{layer}_{e.row_start}"
            if key not in host:
                continue
            _, start, m, _ = next(c for c in chunks if c[0] == e.row_start)
            rows = host[key]                                    # [Hq, m, start + m]
            pat = tr.prefill_pattern.get(layer)
            if pat is None:
                pat = np.full((rows.shape[0], P, P), np.nan, dtype=np.float32)
                tr.prefill_pattern[layer] = pat
            if tr.prefill_computed is None:
                tr.prefill_computed = np.zeros(P, dtype=bool)
            pat[:, start:start + m, :start + m] = rows
            pat[:, start:start + m, start + m:] = 0.0           # causal: no weight on the future
            tr.prefill_computed[start:start + m] = True

    def settle(self, seq, verdict) -> None:
        """A watched request's verify is decided (spec_decode.DraftVerdict): keep what the
        step recorded for the tokens it kept — the newest token, the accepted drafts and the
        query that chose the target's own token — and drop the rejected drafts' rows, so the
        trace reads as plain decoding's. The verdict joins the trace (the Layers tab opens it)."""
        lens, rows = self._unsettled.pop(seq.request_id, ((), ()))
        tr = self.traces.get(seq.request_id)
        if tr is None:
            return
        tr.drafts.append(verdict)
        # rows (norms, routing) of positions < position + num_accepted hold kept tokens; the
        # query at position - 1 + j (j <= num_accepted) chose the j-th emitted token
        _truncate_rows(tr, verdict.position + verdict.num_accepted)
        last = verdict.position + verdict.num_accepted - 1
        tr.lens.extend(st for st in lens if st.position <= last)
        for st in rows:
            if st.position <= last:
                self._add_attention(tr, st)

    def finish_request(self, seq) -> None:
        self._active.discard(seq.request_id)
        self._unsettled.pop(seq.request_id, None)
        tr = self.traces.get(seq.request_id)
        if tr is not None:
            tr.output_token_ids = list(seq.output_token_ids)
            tr.finished = True
            if tr.drafts:   # a stop inside a verify: nothing past the last token (plain's view)
                n = len(tr.prompt_token_ids) + len(tr.output_token_ids)
                _truncate_rows(tr, n - 1)
                while tr.lens and tr.lens[-1].position > n - 2:
                    tr.lens.pop()
                while tr.attention and tr.attention[-1].position > n - 2:
                    tr.attention.pop()

    def _add_attention(self, tr: RequestTrace, step: AttentionStep) -> None:
        """Into the trace in query-position order (a recomputed step replaces its old row)."""
        rows = step.device_rows
        if rows is not None and rows.device.type == "cpu":
            step.set_host(rows.numpy())         # the CPU engine: already host memory
        if not tr.attention or tr.attention[-1].position < step.position:
            tr.attention.append(step)
        else:
            at = next(i for i, o in enumerate(tr.attention) if o.position >= step.position)
            if tr.attention[at].position == step.position:
                tr.attention[at] = step
            else:
                tr.attention.insert(at, step)
        self.attention_store.add(tr.request_id, step)

    def read(self, request_id: str) -> RequestTrace:
        """A frozen copy of the trace so far (under the engine lock; RequestTrace.frozen), or
        KeyError saying why there is none. Its token texts are those decoded so far:
        `decode_texts` (outside the lock) adds the rest."""
        tr = self.traces.get(request_id)
        if tr is None:
            if request_id in self._evicted:
                raise KeyError(f"the trace of {request_id!r} was evicted: only the newest "
                               f"{self.max_traces} traces are kept (LLM(max_traces=...))")
            raise KeyError(f"no trace for {request_id!r}: it was never watched (pass watch="
                           "ProbeSpec() to stream/generate to record one)")
        return tr.frozen()

    def decode_texts(self, tr: RequestTrace) -> list[str]:
        """Decode the texts a frozen copy lacks (no lock needed: the tokenizer and the copy are
        the reader's); returns the new texts, for `keep_texts`."""
        ids = tr.prompt_token_ids + tr.output_token_ids
        dec = self.decode or (lambda t: str(t[0]))
        new = [dec([t]) for t in ids[len(tr.token_texts):]]
        tr.token_texts.extend(new)
        return new

    def keep_texts(self, request_id: str, start: int, texts: list[str]) -> None:
        """Texts a reader decoded, from position `start`, kept in the live trace so the next
        reader need not decode them again (under the engine lock)."""
        tr = self.traces.get(request_id)
        if tr is not None and len(tr.token_texts) == start:
            tr.token_texts.extend(texts)

    def release_device(self) -> None:
        """Engine shutdown: attention rows move to the host (traces stay readable), so no
        trace keeps device memory alive."""
        self.attention_store.flush()
        self._active.clear()


def _truncate_rows(tr: RequestTrace, n: int) -> None:
    """Keep the per-token rows (norms, routing) of positions < n."""
    for name in ("resid_norms", "router_probs", "router_topk_ids", "router_topk_weights",
                 "shared_expert_gate"):
        rows = getattr(tr, name)
        if len(rows) > n:
            del rows[n:]


def _put_rows(lst: list, pos: int, rows: np.ndarray) -> None:
    """_put of rows[i] at pos + i for every i: a 1,024-token prefill's rows appended as views of
    one array (a copy and a _put per token were ~2 ms of a watched prefill's host time)."""
    if pos == len(lst):
        lst.extend(rows)
    else:
        for i, row in enumerate(rows):
            _put(lst, pos + i, row)


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
