"""EngineCore: one engine step, single-threaded. schedule -> prepare -> forward -> sample ->
postprocess -> detokenize, with the time of each phase recorded in a StepTrace."""
from __future__ import annotations

import time
from collections import deque


from .block_manager import BlockManager
from .detokenizer import IncrementalDetokenizer
from .model_runner import build_step_inputs
from .sampling import SamplingTensors, sample
from .scheduler import Scheduler
from .sequence import Sequence, TokenEvent, TokenLogprobs
from .probes.snapshot import StepEntry, StepTrace


class EngineCore:
    def __init__(self, runner, scheduler: Scheduler, block_manager: BlockManager, tokenizer,
                 eos_token_ids: set[int], probes=None, trace_history: int = 256):
        self.runner = runner                 # ModelRunner, or a TP driver with the same API
        self.scheduler = scheduler
        self.bm = block_manager
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.probes = probes
        self.steps: deque[StepTrace] = deque(maxlen=trace_history)
        self.step_id = 0
        self.detok: dict[str, IncrementalDetokenizer] = {}

    def add(self, seq: Sequence) -> None:
        if self.tokenizer is not None:      # token-id-only engines (benchmarks) skip all text work
            self.detok[seq.request_id] = IncrementalDetokenizer(self.tokenizer, seq.params.stop)
        self.scheduler.add(seq)

    def abort(self, seq: Sequence) -> TokenEvent:
        self.scheduler.finish(seq, "abort")
        return self._final_event(seq)

    def _final_event(self, seq: Sequence, token: int | None = None,
                     lp: TokenLogprobs | None = None) -> TokenEvent:
        d = self.detok.pop(seq.request_id, None)
        if d is not None:
            if seq.finish_reason != "stop" or not d.stopped:
                if not d.stopped:
                    d.flush_final(self._visible_ids(seq))
            delta = d.take(final=True)
            seq.output_text = d.text
        else:
            delta = ""
        seq.finish_time = time.perf_counter()
        if self.probes is not None:
            self.probes.finish_request(seq)
        return TokenEvent(seq.request_id, token, delta, seq.output_text, True,
                          seq.finish_reason, lp, seq.metrics())

    def _visible_ids(self, seq: Sequence) -> list[int]:
        return seq.output_token_ids

    def step(self) -> list[TokenEvent]:
        t0 = time.perf_counter()
        scheduled = self.scheduler.schedule()
        if not scheduled:
            return []
        t1 = time.perf_counter()
        plan = self.probes.plan(scheduled) if self.probes is not None else None
        inp = build_step_inputs(scheduled, self.bm.block_size, plan)
        sampling = [s for s in scheduled if s.samples]
        st = SamplingTensors.build(
            [s.seq.params for s in sampling], [s.seq.seed for s in sampling],
            [len(s.seq) for s in sampling], self._banned(sampling), self.runner.device)
        t2 = time.perf_counter()
        logits, bufs = self.runner.execute_step(inp)
        t3 = time.perf_counter()
        tokens, chosen_lp, top_ids, top_lp = sample(logits, st) if len(sampling) else (None,) * 4
        if plan is not None:
            self.probes.after_sample(plan, bufs, tokens)
        tok_list = tokens.tolist() if tokens is not None else []     # the step's one host sync
        t4 = time.perf_counter()
        events = self._postprocess(scheduled, sampling, tok_list, chosen_lp, top_ids, top_lp,
                                   max_lp=st.max_logprobs)
        if plan is not None:
            self.probes.collect(plan, bufs, scheduled, tok_list)
        t5 = time.perf_counter()
        self._record(scheduled, t0, t1 - t0, t2 - t1, t3 - t2, (t4 - t3) + (t5 - t4), bufs)
        return events

    def _banned(self, sampling) -> list[tuple[int, int]]:
        out = []
        for row, s in enumerate(sampling):
            p = s.seq.params
            if s.seq.num_output_tokens < p.min_tokens:
                ids = set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_token_ids)
                out.extend((row, t) for t in ids)
        return out

    def _postprocess(self, scheduled, sampling, tokens, chosen_lp, top_ids, top_lp, max_lp):
        lps: list[TokenLogprobs | None] = [None] * len(sampling)
        if any(s.seq.params.logprobs for s in sampling):
            c, ti, tl = chosen_lp.tolist(), top_ids.tolist(), top_lp.tolist()
            for r, s in enumerate(sampling):
                k = s.seq.params.logprobs
                if k:
                    lps[r] = TokenLogprobs(tokens[r], c[r], dict(zip(ti[r][:k], tl[r][:k])))
        now = time.perf_counter()
        got = self.scheduler.postprocess(scheduled, tokens)
        events = []
        for r, seq in enumerate(got):
            if lps[r] is not None:
                seq.logprobs.append(lps[r])
            if seq.first_token_time is None:
                seq.first_token_time = now
            d = self.detok.get(seq.request_id)
            if d is not None:
                d.add(seq.token_ids, seq.num_prompt_tokens)
                if d.stopped and not seq.is_finished:
                    self.scheduler.finish(seq, "stop")
            if seq.is_finished:
                events.append(self._final_event(seq, tokens[r], lps[r]))
            else:
                delta = d.take(final=False) if d is not None else ""
                seq.output_text = d.text[:d.emitted] if d is not None else ""
                events.append(TokenEvent(seq.request_id, tokens[r], delta, seq.output_text,
                                         False, None, lps[r]))
        return events

    def _record(self, scheduled, t_start, t_sched, t_prep, t_fwd, t_sample, bufs) -> None:
        entries, n_pre, n_dec = [], 0, 0
        for s in scheduled:
            n = s.num_tokens
            if n == 1 and s.start >= s.seq.num_prompt_tokens:
                entries.append(StepEntry(s.seq.request_id, "decode", 1, s.start))
                n_dec += 1
            else:
                entries.append(StepEntry(s.seq.request_id, "prefill", n, s.start))
                n_pre += n
        used = self.bm.num_blocks - self.bm.num_free_blocks
        info = self.runner.last_step_info()
        self.steps.append(StepTrace(
            step_id=self.step_id, wall_time=time.time(), entries=entries,
            num_prefill_tokens=n_pre, num_decode_tokens=n_dec, t_schedule=t_sched,
            t_prepare=t_prep, t_forward=t_fwd, t_sample=t_sample,
            graph_bucket=info.get("graph_bucket"), num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting), kv_usage=used / self.bm.num_blocks,
            expert_load=info.get("expert_load"), collectives=info.get("collectives", 0)))
        self.step_id += 1
