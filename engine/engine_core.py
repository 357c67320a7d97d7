"""EngineCore: the step loop. schedule -> prepare -> launch (forward + sampling on the device)
-> postprocess (resolve tokens, stop rules, detokenize, probes, step trace).

With overlap scheduling (the default on a GPU) step N+1 is scheduled, prepared and launched
while step N still runs; step N is postprocessed after that, so the device always has the next
step queued and the host's Python runs in its shadow. Tokens sampled by step N feed step N+1
from the device (`StepInputs.pending_rows`). With overlap off (the CPU default) each step is
postprocessed right after its launch: the same code, one step in flight at most.

The lock is held only while engine state changes (scheduling, postprocessing), not during the
forward or while waiting for the device: inspect/abort/new requests are never starved.

A failure caused by one request's data fails that request only: an exception while launching a
batch re-runs its requests one by one, and a failure in one request's postprocessing stays
with it. The engine goes on serving the others.
"""
from __future__ import annotations

import contextlib
import time
from collections import deque
from dataclasses import dataclass

from .block_manager import BlockManager
from .detokenizer import IncrementalDetokenizer
from .errors import RequestFailedError, WorkerDiedError
from .probes.snapshot import StepEntry, StepTrace
from .scheduler import ScheduledSeq, Scheduler
from .sequence import Sequence, TokenEvent, TokenLogprobs
from .step_inputs import SamplingBatch, StepInputs, build_step_inputs, prompt_logprob_rows
from .step_output import StepOutput


@dataclass
class InFlight:
    """A launched step awaiting its postprocessing."""
    scheduled: list[ScheduledSeq]
    inp: StepInputs
    out: StepOutput
    t_start: float
    t_schedule: float
    t_prepare: float


class EngineCore:
    def __init__(self, runner, scheduler: Scheduler, block_manager: BlockManager, tokenizer,
                 eos_token_ids: set[int], probes=None, trace_history: int = 256,
                 overlap: bool = False, lock=None):
        self.runner = runner                 # ModelRunner, or a TP driver with the same API
        self.scheduler = scheduler
        self.bm = block_manager
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.probes = probes
        self.overlap = overlap
        self.lock = lock if lock is not None else contextlib.nullcontext()
        self.steps: deque[StepTrace] = deque(maxlen=trace_history)
        self.step_id = 0
        self.detok: dict[str, IncrementalDetokenizer] = {}
        self.inflight: InFlight | None = None
        # requests failed by their own data, for the caller to deliver the error to
        self.failed: list[tuple[Sequence, BaseException]] = []
        # events made outside the normal path (isolation's solo steps): returned by the next step
        self.carry_events: list[TokenEvent] = []

    # ---- requests ----------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        if self.tokenizer is not None:      # token-id-only engines (benchmarks) skip all text work
            self.detok[seq.request_id] = IncrementalDetokenizer(self.tokenizer, seq.params.stop)
        self.scheduler.add(seq)

    def has_work(self) -> bool:
        return self.inflight is not None or self.scheduler.has_work()

    def abort(self, seq: Sequence) -> TokenEvent:
        self.scheduler.finish(seq, "abort")
        return self._final_event(seq)

    def _fail(self, seq: Sequence, err: BaseException) -> None:
        """Fail one request: free its blocks, hand the error to its caller."""
        if not seq.is_finished:
            self.scheduler.finish(seq, "abort")
        self.detok.pop(seq.request_id, None)
        if self.probes is not None:
            self.probes.finish_request(seq)
        self.failed.append((seq, err))

    def _final_event(self, seq: Sequence, token: int | None = None,
                     lp: TokenLogprobs | None = None) -> TokenEvent:
        d = self.detok.pop(seq.request_id, None)
        if d is not None:
            if not d.stopped:
                out_ids = seq.output_token_ids
                if seq.finish_reason == "stop" and out_ids and \
                        out_ids[-1] in seq.params.stop_token_ids:
                    out_ids = out_ids[:-1]      # vLLM: a stop token's text is not in the reply
                d.flush_final(out_ids)
            delta = d.take(final=True)
            seq.output_text = d.text
        else:
            delta = ""
        seq.finish_time = time.perf_counter()
        if self.probes is not None:
            self.probes.finish_request(seq)
        return TokenEvent(seq.request_id, token, delta, seq.output_text, True,
                          seq.finish_reason, lp, seq.metrics())

    # ---- the step ----------------------------------------------------------------------------
    def step(self) -> list[TokenEvent]:
        """Launch the next step (if any), then postprocess the one before it. Call without the
        lock held: it takes the lock for the parts that change engine state."""
        t0 = time.perf_counter()
        carried: list[TokenEvent] = []
        if self.overlap and self.inflight is not None and any(
                s.seq.grammar is not None for s in self.inflight.scheduled):
            # a guided request's next mask needs the token in flight: no overlap this step
            carried = self.drain()
        with self.lock:
            launch = self._prepare(t0)
        launched = None
        if launch is not None:
            launched = self._launch(*launch)
        events, self.carry_events = carried + self.carry_events, []
        if self.overlap:
            prev, self.inflight = self.inflight, launched
            if prev is not None:
                events += self._complete(prev)
        elif launched is not None:
            events += self._complete(launched)
        return events

    def drain(self) -> list[TokenEvent]:
        """Postprocess the step in flight, if any (before shutdown, or isolation)."""
        prev, self.inflight = self.inflight, None
        return self._complete(prev) if prev is not None else []

    def _prepare(self, t0: float):
        """Schedule and build the inputs (under the lock). None when nothing is runnable."""
        scheduled = self.scheduler.schedule()
        if not scheduled:
            return None
        t1 = time.perf_counter()
        step_id = self.step_id
        self.step_id += 1
        prev = self.inflight.inp.step_id if self.inflight is not None else -1
        inp = self._inputs(step_id, scheduled, prev)
        return scheduled, inp, t0, t1 - t0, time.perf_counter() - t1

    def _inputs(self, step_id: int, scheduled, prev_step_id: int) -> StepInputs:
        plan = self.probes.plan(scheduled) if self.probes is not None else None
        sampling = [s for s in scheduled if s.samples]
        batch = SamplingBatch.build([s.seq.params for s in sampling],
                                    [s.seq.seed for s in sampling],
                                    [len(s.seq) for s in sampling],
                                    self._banned(sampling)) if sampling else None
        if batch is not None:
            from .penalties import PenaltyBatch
            if any(PenaltyBatch.needed(s.seq.params) for s in sampling):
                batch.penalties = PenaltyBatch.build([s.seq for s in sampling], prev_step_id)
            if any(s.seq.grammar is not None for s in sampling):
                from .guided import fill_bitmask
                batch.grammar_mask = fill_bitmask([s.seq.grammar for s in sampling])
        return build_step_inputs(step_id, scheduled, self.bm.block_size, batch, plan,
                                 prev_step_id)

    def _launch(self, scheduled, inp: StepInputs, t0, t_sched, t_prep) -> InFlight | None:
        try:
            out = self.runner.execute_step(inp)
        except WorkerDiedError:
            raise
        except Exception as e:              # noqa: BLE001 — attribute it to a request
            return self._isolate(scheduled, e)
        with self.lock:
            self.scheduler.on_launch(scheduled, inp.step_id)
        return InFlight(scheduled, inp, out, t0, t_sched, t_prep)

    def _isolate(self, scheduled, err: BaseException) -> None:
        """A batch failed to launch: finish the step in flight, then run each of its requests
        alone; the ones that fail alone are failed, the others go on (their solo steps are
        postprocessed here, and their events returned by the next step)."""
        self.carry_events += self.drain()
        if len(scheduled) == 1:
            with self.lock:
                self._fail(scheduled[0].seq,
                           RequestFailedError(f"this request failed in the engine: {err!r}"))
            return None
        for s in scheduled:
            with self.lock:
                if s.seq.is_finished:
                    continue
                t0 = time.perf_counter()
                step_id = self.step_id
                self.step_id += 1
                inp = self._inputs(step_id, [s], -1)
            try:
                out = self.runner.execute_step(inp)
            except WorkerDiedError:
                raise
            except Exception as e:          # noqa: BLE001
                with self.lock:
                    self._fail(s.seq, RequestFailedError(f"this request failed in the engine: {e!r}"))
                continue
            with self.lock:
                self.scheduler.on_launch([s], step_id)
            self.carry_events += self._complete(InFlight([s], inp, out, t0, 0.0, 0.0))
        return None

    def _complete(self, f: InFlight) -> list[TokenEvent]:
        """Wait for a launched step, then postprocess it (under the lock)."""
        t_wait = f.out.wait(getattr(self.runner, "check_workers", None))
        with self.lock:
            t3 = time.perf_counter()
            events = self._postprocess(f)
            self._record(f, t_wait, time.perf_counter() - t3)
        return events

    def _banned(self, sampling) -> list[tuple[int, int]]:
        out = []
        for row, s in enumerate(sampling):
            p = s.seq.params
            if s.seq.num_output_tokens < p.min_tokens:
                ids = set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_token_ids)
                out.extend((row, t) for t in ids)
        return out

    def _postprocess(self, f: InFlight) -> list[TokenEvent]:
        out, scheduled = f.out, f.scheduled
        tokens = out.tokens
        sampling = [s for s in scheduled if s.samples]
        lps: list[TokenLogprobs | None] = [None] * len(sampling)
        if out.logprobs_host is not None:
            c, ti, tl = (x.tolist() for x in out.logprobs_host)
            for r, s in enumerate(sampling):
                k = s.seq.params.logprobs
                if k:
                    lps[r] = TokenLogprobs(tokens[r], c[r], dict(zip(ti[r][:k], tl[r][:k])))
        if out.prompt_logprobs_host is not None:
            self._store_prompt_logprobs(scheduled, out.prompt_logprobs_host)
        expert_load = None
        if f.inp.probe_plan is not None and self.probes is not None:
            try:
                expert_load = self.probes.fold(f.inp.probe_plan, out.probes,
                                               [s.seq for s in scheduled], tokens)
            except Exception as e:          # noqa: BLE001 — a probe bug fails the watched ones
                for entry in f.inp.probe_plan.entries:
                    seq = scheduled[entry.batch_index].seq
                    self._fail(seq, RequestFailedError(f"recording this request's probes failed: {e!r}"))
        f.out.extra["expert_load"] = expert_load
        row_of = {id(s.seq): r for r, s in enumerate(sampling)}
        now = time.perf_counter()
        events = []
        for seq, tok in self.scheduler.on_result(scheduled, tokens, f.inp.step_id):
            r = row_of[id(seq)]
            try:
                events.append(self._token_event(seq, tok, lps[r], now))
            except Exception as e:          # noqa: BLE001 — this request's text work failed
                self._fail(seq, RequestFailedError(f"postprocessing this request failed: {e!r}"))
        return events

    @staticmethod
    def _store_prompt_logprobs(scheduled, host) -> None:
        """Each computed prompt token's logprob into its request, by position (the rows are in
        prompt_logprob_rows' order; a recomputed prefill overwrites with the same values)."""
        c, rank, ti, tl = (x.tolist() for x in host)
        for i, (_, seq, pos) in enumerate(prompt_logprob_rows(scheduled)):
            k = seq.params.prompt_logprobs
            if seq.prompt_logprobs is not None:
                seq.prompt_logprobs[pos] = TokenLogprobs(seq.token_ids[pos], c[i],
                                                         dict(zip(ti[i][:k], tl[i][:k])), rank[i])

    def _token_event(self, seq: Sequence, tok: int, lp, now: float) -> TokenEvent:
        if lp is not None:
            seq.logprobs.append(lp)
        if seq.grammar is not None:
            seq.num_masked_steps += 1
            seq.grammar.consume(tok)       # a refusal fails this request (postprocess)
        first = seq.first_token_time is None
        if first:
            seq.first_token_time = now
        d = self.detok.get(seq.request_id)
        if d is not None:
            d.add(seq.token_ids, seq.num_prompt_tokens, seq.num_resolved_tokens)
            if d.stopped and not seq.is_finished:
                self.scheduler.finish(seq, "stop")
        if seq.is_finished:
            ev = self._final_event(seq, tok, lp)
        else:
            delta = d.take(final=False) if d is not None else ""
            seq.output_text = d.text[:d.emitted] if d is not None else ""
            ev = TokenEvent(seq.request_id, tok, delta, seq.output_text, False, None, lp)
        if first and seq.prompt_logprobs is not None:
            ev.prompt_logprobs = list(seq.prompt_logprobs)
        return ev

    def _record(self, f: InFlight, t_wait: float, t_post: float) -> None:
        entries, n_pre, n_dec = [], 0, 0
        for s in f.scheduled:
            n = s.num_tokens
            if n == 1 and s.start >= s.seq.num_prompt_tokens:
                entries.append(StepEntry(s.seq.request_id, "decode", 1, s.start))
                n_dec += 1
            else:
                entries.append(StepEntry(s.seq.request_id, "prefill", n, s.start))
                n_pre += n
        out = f.out
        used = self.bm.num_blocks - self.bm.num_free_blocks
        gpu = out.gpu_time
        self.steps.append(StepTrace(
            step_id=f.inp.step_id, wall_time=time.time(), entries=entries,
            num_prefill_tokens=n_pre, num_decode_tokens=n_dec, t_schedule=f.t_schedule,
            t_prepare=f.t_prepare, t_forward=gpu if gpu is not None else out.t_launch,
            t_sample=t_post, graph_bucket=out.graph_bucket,
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            kv_usage=used / self.bm.num_blocks, expert_load=out.extra.get("expert_load"),
            collectives=out.collectives, t_launch=out.t_launch, t_wait=t_wait,
            collective_time=out.collective_time, overlapped=self.overlap))
