"""EngineCore: the step loop. schedule -> prepare -> launch (forward + sampling on the device)
-> postprocess (resolve tokens, stop rules, detokenize, probes, step trace).

With overlap scheduling (the GPU default) step N+1 is launched while step N still runs, and
step N is postprocessed after that, so the host's Python runs in the device's shadow; tokens
sampled by step N feed step N+1 from the device (`StepInputs.pending_rows`). Without it (the
CPU default) each step is postprocessed right after its launch. The lock is held only while
engine state changes, never during the forward or the wait: readers never starve.

A failure caused by one request's data fails that request only: a batch whose inputs or launch
fail is re-run request by request, and a failure in one request's postprocessing stays with it.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

from .block_manager import BlockManager
from .detokenizer import IncrementalDetokenizer
from .errors import RequestFailedError, WorkerDiedError
from .grammar_masks import GrammarMasks, LateMask
from .penalty_slots import PenaltySlots
from .records import StepEntries, StepTrace
from .scheduler import ScheduledSeq, Scheduler
from .sequence import Sequence, TokenEvent, TokenLogprobs
from .spec_decode.config import SpeculativeConfig
from .spec_decode.grammar import verify_grammars
from .spec_decode.state import SpecState
from .step_history import StepHistory
from .step_inputs import SamplingBatch, StepInputs, build_step_inputs, prompt_logprob_rows
from .step_output import StepOutput


@dataclass
class StepResult:
    """Everything one call of `EngineCore.step()` produced: the only way results leave it."""
    events: list[TokenEvent] = field(default_factory=list)
    # requests failed by their own data: (request id, the error for its caller)
    failures: list[tuple[str, BaseException]] = field(default_factory=list)
    # tokens (prefill + decode) of each engine step postprocessed (vLLM's iteration tokens)
    step_tokens: list[int] = field(default_factory=list)

    def extend(self, other: "StepResult") -> None:
        self.events += other.events
        self.failures += other.failures
        self.step_tokens += other.step_tokens


@dataclass
class PrepareFailed:
    """A scheduled batch whose inputs could not be built: its requests are run one by one."""
    scheduled: list[ScheduledSeq]
    error: BaseException


@dataclass
class InFlight:
    """A launched step awaiting its postprocessing."""
    scheduled: list[ScheduledSeq]
    inp: StepInputs
    out: StepOutput
    t_schedule: float
    t_prepare: float


def _allowed(seq):
    """The request's allowed_token_ids bitmask, or None."""
    f = seq.token_filter
    return f.allowed if f is not None else None


def _needs_history(seq) -> bool:
    """A multi-token bad word: the next step's bans need the request's newest token."""
    f = seq.token_filter
    return f is not None and f.bad_words is not None and f.bad_words.needs_history


class EngineCore:
    def __init__(self, runner, scheduler: Scheduler, block_manager: BlockManager, tokenizer,
                 eos_token_ids, steps: StepHistory, *, probes=None, interventions=None,
                 overlap: bool = False, lock=None, on_idle=None,
                 speculative_config: SpeculativeConfig | None = None, draft=None):
        self.runner = runner                 # a Runner (engine/runner.py): local or a TP driver
        self.scheduler = scheduler
        self.bm = block_manager
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.steps = steps                   # the step traces readers see (engine/inspector.py)
        self.probes = probes                 # probes.manager.ProbeManager, or None
        self.interventions = interventions   # interventions.plan.InterventionPlanner, or None
        self.overlap = overlap
        self.lock = lock if lock is not None else contextlib.nullcontext()
        # called while the host waits for the device (a waiting reader's snapshot is copied)
        self.on_idle = on_idle
        self.step_id = 0
        self.detok: dict[str, IncrementalDetokenizer] = {}
        self.inflight: InFlight | None = None
        self.penalty_slots = PenaltySlots()  # penalised requests' device count rows
        self.masks = GrammarMasks()         # guided rows' bitmask buffers
        self.speculative_config = speculative_config
        self.speculating = False            # some request was added with speculation on
        # seq -> a proposer (token_ids, k) -> drafts for that request, or None for n-gram: the
        # benchmark's oracle proposer; the engine itself never sets it
        self.proposer_for = None
        # spec_decode.draft_model.DraftModel when the speculative_config names a draft `model`:
        # its proposals for every request about to verify are made in one batch per step
        self.draft = draft
        self._t_propose: dict[int, float] = {}  # step id -> seconds its drafts took to propose

    # ---- requests ----------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        if self.tokenizer is not None:      # token-id-only engines (benchmarks) skip all text work
            p = seq.params
            self.detok[seq.request_id] = IncrementalDetokenizer(
                self.tokenizer, p.stop, include_stop=p.include_stop_str_in_output,
                skip_special_tokens=p.skip_special_tokens,
                spaces_between_special_tokens=p.spaces_between_special_tokens)
        if self.interventions is not None:
            self.interventions.add(seq)
        self._speculation(seq)
        self.scheduler.add(seq)

    def _speculation(self, seq: Sequence) -> None:
        """Give seq a SpecState when it speculates: the request's num_speculative_tokens, else
        the engine's. Requests with interventions (they index decode rows) decode plainly; a
        watched one speculates, its probes recording every verified row and keeping those of
        accepted tokens (ProbeManager.settle)."""
        cfg, k = self.speculative_config, seq.params.num_speculative_tokens
        if k is None:
            k = cfg.num_speculative_tokens if cfg is not None else 0
        # bad_words ban per plain row (_banned): a verify entry's rows would miss them
        bad_words = seq.token_filter is not None and seq.token_filter.bad_words is not None
        if not k or seq.interventions or bad_words:
            return
        if self.proposer_for is not None:
            proposer = self.proposer_for(seq)
        elif self.draft is not None:
            proposer = self.draft.proposer(seq)
        else:
            proposer = None                 # n-gram prompt lookup
        # an empty lookup costs a drained step only when steps overlap: rest only then
        seq.spec = SpecState(cfg if cfg is not None else SpeculativeConfig(), k, proposer,
                             rest_when_empty=self.overlap)
        self.speculating = True

    def has_work(self) -> bool:
        return self.inflight is not None or self.scheduler.has_work()

    def abort(self, seq: Sequence) -> TokenEvent:
        self.scheduler.finish(seq, "abort")
        return self._final_event(seq)

    def _fail(self, seq: Sequence, err: BaseException, res: StepResult) -> None:
        """Fail one request: free its blocks; the result hands the error to its caller."""
        if not seq.is_finished:
            self.scheduler.finish(seq, "abort")
        self.detok.pop(seq.request_id, None)
        if self.probes is not None:
            self.probes.finish_request(seq)
        res.failures.append((seq.request_id, err))

    def _fail_alone(self, seq: Sequence, err: BaseException, res: StepResult) -> None:
        self._fail(seq, RequestFailedError(f"this request failed in the engine: {err!r}"), res)

    def _final_event(self, seq: Sequence, token: int | None = None,
                     lp: TokenLogprobs | None = None) -> TokenEvent:
        d = self.detok.pop(seq.request_id, None)
        if d is not None:
            if not d.stopped:
                out_ids = seq.output_token_ids
                if seq.finish_reason == "stop" and out_ids and \
                        not seq.params.include_stop_str_in_output and \
                        (out_ids[-1] in seq.params.stop_token_ids
                         or out_ids[-1] in self.eos_token_ids):
                    # vLLM: the text of the stop token (or EOS) that ended it is not in the
                    # reply, unless include_stop_str_in_output
                    out_ids = out_ids[:-1]
                d.flush_final(out_ids)
            delta = d.take(final=True)
            seq.output_text = d.text
        else:
            delta = ""
        seq.finish_time = time.perf_counter()
        if self.probes is not None:
            self.probes.finish_request(seq)
        return TokenEvent(seq.request_id, token, delta, seq.output_text, True,
                          seq.finish_reason, lp, seq.metrics(),
                          resid_capture=seq.resid_capture)

    # ---- the step ----------------------------------------------------------------------------
    def step(self) -> StepResult:
        """Launch the next step (if any), then postprocess the one before it. Call without the
        lock held: it takes the lock for the parts that change engine state."""
        res = StepResult()
        t0 = time.perf_counter()
        if self.overlap and self.inflight is not None and any(
                (s.seq.grammar is not None and not self.runner.fills_masks_late)
                or _needs_history(s.seq) for s in self.inflight.scheduled):
            # a guided request's next mask needs the token in flight, and this runner cannot
            # take the mask after the forward's launch (TP: the inputs cross processes first);
            # a multi-token bad word is banned by the newest tokens: no overlap this step
            res.extend(self.drain())
        elif self.speculating and self.overlap and self.inflight is not None and any(
                self.scheduler.speculates_now(s.seq) for s in self.inflight.scheduled):
            # drafts continue the newest token, which must be on the host: no overlap (a batch
            # past disable_by_batch_size drafts nothing, so it keeps overlapping)
            res.extend(self.drain())
        with self.lock:
            launch = self._prepare(t0)
        launched = None
        if isinstance(launch, PrepareFailed):   # a request's data broke building the inputs
            self._isolate(launch.scheduled, launch.error, res)
        elif launch is not None:
            launched = self._launch(*launch, res)
        if self.overlap:
            prev, self.inflight = self.inflight, launched
            if prev is not None:
                self._complete(prev, res)
        elif launched is not None:
            self._complete(launched, res)
        return res

    def drain(self) -> StepResult:
        """Postprocess the step in flight, if any (before shutdown, or isolation)."""
        res = StepResult()
        prev, self.inflight = self.inflight, None
        if prev is not None:
            self._complete(prev, res)
        return res

    def _prepare(self, t0: float):
        """Schedule and build the inputs (under the lock). None when nothing is runnable."""
        t_draft = 0.0
        if self.draft is not None and self.speculating:
            # the draft model's forwards for every request that may verify, batched; the
            # scheduler's _draft then takes each request's drafts
            t_draft = time.perf_counter()
            self.draft.prefetch(self.scheduler)
            t_draft = time.perf_counter() - t_draft
        scheduled = self.scheduler.schedule()
        if not scheduled:
            return None
        t1 = time.perf_counter()
        step_id = self.step_id
        self.step_id += 1
        if self.speculating and self.scheduler.t_propose + t_draft:
            self._t_propose[step_id] = self.scheduler.t_propose + t_draft
        prev = self.inflight.inp.step_id if self.inflight is not None else -1
        try:
            inp = self._inputs(step_id, scheduled, prev)
        except WorkerDiedError:
            raise
        except Exception as e:              # noqa: BLE001 — attribute it to a request
            self.penalty_slots.invalidate([s.seq for s in scheduled])
            self._t_propose.pop(step_id, None)  # this step id is never recorded
            return PrepareFailed(scheduled, e)
        return scheduled, inp, t1 - t0, time.perf_counter() - t1

    def _inputs(self, step_id: int, scheduled, prev_step_id: int) -> StepInputs:
        plan = self.probes.plan(scheduled) if self.probes is not None else None
        sampling = [s for s in scheduled if s.samples]
        if sampling and sampling[-1].num_draft:     # verify entries (last): 1 + k rows each
            batch, row_seqs = self._verify_batch(sampling)
        else:
            row_seqs = None
            batch = SamplingBatch.build([s.seq.params for s in sampling],
                                        [s.seq.seed for s in sampling],
                                        [len(s.seq) for s in sampling],
                                        self._banned(sampling)) if sampling else None
        if batch is not None:
            if any(s.seq.params.uses_penalties for s in sampling):
                batch.penalties = self.penalty_slots.batch(
                    row_seqs or [s.seq for s in sampling], prev_step_id)
            if any(s.seq.grammar is not None or _allowed(s.seq) is not None
                   for s in sampling):
                self._grammar_mask(batch, sampling, prev_step_id)
        inp = build_step_inputs(step_id, scheduled, self.bm.block_size, batch, plan,
                                prev_step_id, self.runner.kernel_config.cascade_min_saved_tokens)
        if self.interventions is not None and self.interventions.active:
            inp.interventions = self.interventions.plan(scheduled)
        return inp

    def _verify_batch(self, sampling) -> tuple[SamplingBatch, list[Sequence]]:
        """The sampling rows of a step with verify entries: a verify entry's 1 + k rows sample
        the tokens at indices start + 1 .. start + 1 + k with the request's own settings and
        noise (seed, index), exactly as plain decoding would sample each of them; min_tokens
        bans apply per row. Returns the batch and each row's sequence."""
        params, seeds, positions, rows = [], [], [], []
        banned = self._banned([s for s in sampling if not s.num_draft])
        for s in sampling:
            seq = s.seq
            idx = range(s.start + 1, s.start + 2 + s.num_draft) if s.num_draft else [len(seq)]
            for i in idx:
                if s.num_draft and i - seq.num_prompt_tokens < seq.params.min_tokens:
                    banned.extend((len(rows), t) for t in self._min_tokens_bans(seq))
                params.append(seq.params)
                seeds.append(seq.seed)
                positions.append(i)
                rows.append(seq)
        return SamplingBatch.build(params, seeds, positions, banned), rows

    def _grammar_mask(self, batch: SamplingBatch, sampling, prev_step_id: int) -> None:
        """The guided rows' bitmask now, or (a row's newest token still in flight) a LateMask
        the runner fills once it has launched the forward. A verify entry's row j is masked
        as the grammar stands after its drafts 0..j-1 (spec_decode/grammar.py); its
        allowed_token_ids row is the same for each."""
        grammars = [s.seq.grammar for s in sampling if not s.num_draft]
        allowed = [_allowed(s.seq) for s in sampling if not s.num_draft]   # static rows
        for s in sampling:
            if s.num_draft:             # verify entries: after the plain rows
                rows = verify_grammars(s.seq.grammar, s.seq.spec.drafts)
                grammars += rows
                allowed += [_allowed(s.seq)] * len(rows)
        advance = [(s.seq.grammar, pos - s.seq.num_prompt_tokens,
                    s.seq.pending_src(pos, prev_step_id))
                   for s in sampling if s.seq.grammar is not None for pos in s.seq.pending]
        if not advance:
            batch.grammar_mask = self.masks.fill(grammars, allowed)
            return
        batch.grammar_mask_fn = LateMask(self.masks, self.inflight.out,
                                         self.runner.check_workers, grammars, advance, allowed)

    def _launch(self, scheduled, inp: StepInputs, t_sched, t_prep,
                res: StepResult) -> InFlight | None:
        try:
            out = self.runner.execute_step(inp)
        except WorkerDiedError:
            raise
        except Exception as e:              # noqa: BLE001 — attribute it to a request
            # the failed launch may have updated some penalty count rows: rebuild them
            self.penalty_slots.invalidate([s.seq for s in scheduled])
            self._t_propose.pop(inp.step_id, None)
            return self._isolate(scheduled, e, res)
        with self.lock:
            self.scheduler.on_launch(scheduled, inp.step_id)
        return InFlight(scheduled, inp, out, t_sched, t_prep)

    def _isolate(self, scheduled, err: BaseException, res: StepResult) -> None:
        """A batch failed to build its inputs or to launch: finish the step in flight, then run
        each of its requests alone; the ones that fail alone are failed, the others go on (their
        solo steps are postprocessed here, into this step's result)."""
        res.extend(self.drain())
        if len(scheduled) == 1:
            with self.lock:
                self._fail_alone(scheduled[0].seq, err, res)
            return None
        for s in scheduled:
            with self.lock:
                if s.seq.is_finished:
                    continue
                step_id = self.step_id
                self.step_id += 1
                try:
                    inp = self._inputs(step_id, [s], -1)
                except WorkerDiedError:
                    raise
                except Exception as e:      # noqa: BLE001 — this request's own data
                    self.penalty_slots.invalidate([s.seq])
                    self._fail_alone(s.seq, e, res)
                    continue
            try:
                out = self.runner.execute_step(inp)
            except WorkerDiedError:
                raise
            except Exception as e:          # noqa: BLE001
                self.penalty_slots.invalidate([s.seq])
                with self.lock:
                    self._fail_alone(s.seq, e, res)
                continue
            with self.lock:
                self.scheduler.on_launch([s], step_id)
            self._complete(InFlight([s], inp, out, 0.0, 0.0), res)
        return None

    def _complete(self, f: InFlight, res: StepResult) -> None:
        """Wait for a launched step, then postprocess it (under the lock) into `res`."""
        t_wait = f.out.wait(self.runner.check_workers, idle=self.on_idle)
        with self.lock:
            t3 = time.perf_counter()
            expert_load = self._postprocess(f, res)
            self._record(f, t_wait, time.perf_counter() - t3, expert_load)
            res.step_tokens.append(sum(s.num_tokens for s in f.scheduled))

    def _min_tokens_bans(self, seq: Sequence) -> tuple[int, ...]:
        """The ids banned before min_tokens, built once per request (not per step)."""
        if seq.banned_ids is None:
            seq.banned_ids = tuple(seq.stop_token_set | (
                set() if seq.params.ignore_eos else self.eos_token_ids))
        return seq.banned_ids

    def _banned(self, sampling) -> list[tuple[int, int]]:
        out = []
        for row, s in enumerate(sampling):
            if s.seq.num_output_tokens < s.seq.params.min_tokens:
                out.extend((row, t) for t in self._min_tokens_bans(s.seq))
            f = s.seq.token_filter
            if f is not None and f.bad_words is not None:     # every output token is resolved
                out.extend((row, t) for t in f.bad_words.banned(s.seq.output_token_ids))
        return out

    def _postprocess(self, f: InFlight, res: StepResult):
        """Tokens, stop rules, text and probes of a finished step, into `res`; returns the
        step's expert load (MoE, when recorded) for its trace."""
        out, scheduled = f.out, f.scheduled
        tokens = out.tokens
        sampling = [s for s in scheduled if s.samples]
        lps: list[TokenLogprobs | None] = [None] * len(sampling)
        c = ti = tl = None
        if out.logprobs_host is not None:
            c, ti, tl = (x.tolist() for x in out.logprobs_host)
            for r, s in enumerate(sampling):
                k = s.seq.params.logprobs
                if k and not s.num_draft:   # plain rows come first: row r is entry r
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
                    self._fail(seq, RequestFailedError(
                        f"recording this request's probes failed: {e!r}"), res)
        if f.inp.interventions is not None:     # steering vectors: captured resid_post sums
            self.interventions.fold(f.inp.interventions, out.resid_captures, scheduled)
        row_of = {id(s.seq): r for r, s in enumerate(sampling)}
        verify_row = self._verify_rows(sampling) if sampling and sampling[-1].num_draft else None
        now = time.perf_counter()
        for seq, tok in self.scheduler.on_result(scheduled, tokens, f.inp.step_id):
            r = row_of[id(seq)]
            lp, verdict = lps[r], None
            if verify_row is not None and id(seq) in verify_row:
                # the j-th token a verify entry yields is its row first + j
                first, j = verify_row[id(seq)]
                verify_row[id(seq)] = (first, j + 1)
                k = seq.params.logprobs
                if k and c is not None:
                    lp = TokenLogprobs(tok, c[first + j], dict(zip(ti[first + j][:k],
                                                                   tl[first + j][:k])))
                if j == 0:
                    verdict = seq.spec.log[-1]
                    if seq.watch is not None and self.probes is not None:
                        self.probes.settle(seq, verdict)
            try:
                ev = self._token_event(seq, tok, lp, now)
                ev.draft = verdict
                res.events.append(ev)
            except Exception as e:          # noqa: BLE001 — this request's text work failed
                self._fail(seq, RequestFailedError(
                    f"postprocessing this request failed: {e!r}"), res)
        return expert_load

    @staticmethod
    def _verify_rows(sampling) -> dict:
        """id(sequence) -> (its first sampled row, tokens yielded so far) of verify entries."""
        rows, at = {}, 0
        for s in sampling:
            if s.num_draft:
                rows[id(s.seq)] = (at, 0)
            at += 1 + s.num_draft
        return rows

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
            # a refusal fails this request (postprocess); a no-op when a LateMask advanced it
            seq.grammar.consume_at(seq.num_resolved_tokens - 1 - seq.num_prompt_tokens, tok)
        first = seq.first_token_time is None
        if first:
            seq.first_token_time = now
        else:
            seq.token_gaps.append(now - seq.last_token_time)
        seq.last_token_time = now
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

    def _cascade_record(self, inp: StepInputs, out: StepOutput) -> dict:
        """The trace's account of a step that read a shared prefix once for its rows instead of
        once per row (the prefix kernel re-reads it once per 64 packed query rows: the bytes
        saved are an upper bound by that much)."""
        c = inp.cascade
        if c is None or not out.cascade:
            return {}
        per_token = self.runner.bytes_per_block // self.bm.block_size   # K and V, every layer
        return {"cascade_rows": c.rows, "cascade_tokens": c.shared_tokens,
                "kv_bytes_saved": c.saved_tokens * per_token}

    @staticmethod
    def _spec_record(scheduled) -> dict:
        """The trace's account of a step that verified drafts: per verify entry, the request,
        its drafts and how many the target accepted (after postprocessing: from its log)."""
        verifies = tuple((s.seq.request_id, v.drafted, v.num_accepted)
                         for s in scheduled if s.num_draft and s.seq.spec.log
                         for v in s.seq.spec.log[-1:] if v.position == s.start + 1)
        return {"num_draft_tokens": sum(len(d) for _, d, _ in verifies),
                "num_accepted_tokens": sum(a for _, _, a in verifies), "verifies": verifies}

    def _record(self, f: InFlight, t_wait: float, t_post: float, expert_load) -> None:
        sched, out = f.scheduled, f.out
        # a verify (the newest token and its drafts) is a decode
        kinds = ["decode" if s.num_draft or s.num_tokens == 1 and s.start >= s.seq.num_prompt_tokens
                 else "prefill" for s in sched]
        ntok = [s.num_tokens for s in sched]
        n_dec = sum(n for n, kind in zip(ntok, kinds) if kind == "decode")
        entries = StepEntries([s.seq.request_id for s in sched], kinds, ntok,
                              [s.start for s in sched])
        used = self.bm.num_blocks - self.bm.num_free_blocks
        gpu = out.gpu_time
        trace = StepTrace(
            step_id=f.inp.step_id, wall_time=time.time(), entries=entries,
            num_prefill_tokens=sum(ntok) - n_dec, num_decode_tokens=n_dec,
            t_schedule=f.t_schedule,
            t_prepare=f.t_prepare, t_forward=gpu if gpu is not None else out.t_launch,
            t_sample=t_post, graph_bucket=out.graph_bucket,
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            kv_usage=used / self.bm.num_blocks, expert_load=expert_load,
            collectives=out.collectives, t_launch=out.t_launch, t_wait=t_wait,
            collective_time=out.collective_time, overlapped=self.overlap,
            t_propose=self._t_propose.pop(f.inp.step_id, 0.0) if self.speculating else 0.0,
            **(self._spec_record(sched) if any(s.num_draft for s in sched) else {}),
            **self._cascade_record(f.inp, out))
        self.steps.append(trace)
