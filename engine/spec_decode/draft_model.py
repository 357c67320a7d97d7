"""The draft-model proposer: a smaller Qwen with the target's tokenizer runs k greedy decode
steps per verify, through a ModelRunner with its own paged KV cache and BlockManager, batched
over every request about to verify.

A request's draft cache holds the context tokens the draft has seen plus the drafts it fed
itself, so proposing after a verify never recomputes the context. After a verify it keeps the
accepted drafts' K/V only, and before every proposal it is cut back to the longest prefix it
shares with the request (unverified drafts, a request preempted and re-admitted).

Greedy drafts make q one-hot, so the engine's verify (rejection.num_accepted) stays the exact
rejection rule and a seeded request speculates to its plain tokens; what can change a greedy
choice is applied to the draft's rows as to the target's (draft_sampling.py). With tensor
parallelism the draft runs unsharded on rank 0: its drafts are host token ids anyway.
"""
from __future__ import annotations

import math
from types import SimpleNamespace

from ..block_manager import BlockManager
from ..errors import InvalidArgumentError
from ..grammar_masks import GrammarMasks
from ..scheduler import ScheduledSeq
from ..step_inputs import build_step_inputs
from .draft_sampling import draft_batch, is_legal

FIELD = "speculative_config.model"


class DraftSeq:
    """One request in the draft's cache: what BlockManager and build_step_inputs read of a
    Sequence (token_ids, block_table), and the request's proposer (SpecState calls it)."""
    # build_step_inputs asks; the draft never computes prompt logprobs
    params = SimpleNamespace(prompt_logprobs=None)

    def __init__(self, draft: "DraftModel", seq):
        self.draft, self.seq, self.request_id = draft, seq, seq.request_id
        self.token_ids: list[int] = []      # fed to the draft (K/V for the computed ones)
        self.block_table: list[int] = []
        self.num_computed_tokens = 0
        self.base = 0           # token_ids[:base] are known to be the request's own tokens
        self.want = 0           # drafts asked of the proposal under way
        self.drafts: list[int] = []
        self.prefetched: tuple | None = None   # (request length, drafts, top guesses)
        self.tops: list[tuple[tuple, tuple]] = []  # per draft: (top ids, top probs); watched only
        # the guesses behind the drafts last handed out, (ids per draft, probs per draft) or
        # None: DraftVerdict.draft_top_ids / draft_top_probs (the Layers tab's rejection view)
        self.last_guesses: tuple[tuple, tuple] | None = None

    def __len__(self) -> int:
        return len(self.token_ids)

    def stop_ids(self):
        """Tokens after which drafting on is wasted: the target would stop there."""
        return self.seq.stop_token_set if self.seq.params.ignore_eos else \
            self.seq.stop_token_set | self.draft.eos_token_ids

    # ---- the proposer protocol SpecState calls --------------------------------------------
    def __call__(self, token_ids, k: int) -> list[int]:
        """Up to k drafts after token_ids: the batched proposal made for this step, or (none
        made for this length) a proposal of this request alone."""
        pre, self.prefetched = self.prefetched, None
        if pre is None or pre[0] != len(token_ids):
            self.draft.propose([(self, k)])
            pre, self.prefetched = self.prefetched, None
        drafts, tops = pre[1][:k], pre[2][:k]
        self.last_guesses = (tuple(t[0] for t in tops), tuple(t[1] for t in tops)) \
            if tops and len(tops) == len(drafts) else None
        return drafts

    def on_verdict(self, verdict) -> None:
        """The target kept `num_accepted` drafts: keep their K/V, drop the rest."""
        self.draft.rollback(self, verdict.position + verdict.num_accepted)

    def release(self) -> None:
        """Finished, preempted or no longer speculating: return every block."""
        self.draft.release(self)


class DraftModel:
    def __init__(self, runner, eos_token_ids, max_num_batched_tokens: int):
        self.runner = runner            # a ModelRunner (one rank: unsharded)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.block_manager: BlockManager | None = None
        self.masks = GrammarMasks()
        self.live: dict[int, DraftSeq] = {}     # id -> requests holding draft blocks
        self.step_id = 0

    def allocate(self, num_blocks: int) -> None:
        """The draft's KV cache (no prefix caching: it holds each request's own context)."""
        self.runner.allocate_kv_cache(num_blocks)
        self.block_manager = BlockManager(num_blocks, self.runner.block_size,
                                          enable_prefix_caching=False)

    def proposer(self, seq) -> DraftSeq:
        return DraftSeq(self, seq)

    # ---- proposing -------------------------------------------------------------------------
    def prefetch(self, scheduler) -> None:
        """Propose for every running request the scheduler may let verify this step, in one
        batch (its _draft then takes them; a request left out proposes alone there)."""
        items = []
        for seq in scheduler.running:
            if scheduler.may_draft(seq) and isinstance(seq.spec.proposer, DraftSeq) and \
                    seq.spec.proposer.draft is self:
                k = min(seq.spec.k, scheduler.draft_limit(seq, scheduler.max_num_batched_tokens))
                if k >= 1:
                    items.append((seq.spec.proposer, k))
        if items:
            self.propose(items)

    def propose(self, items: list[tuple[DraftSeq, int]]) -> None:
        """Up to k greedy drafts for each (request, k) into its `prefetched`. Rounds of one
        forward each: the first feeds each request's tokens the draft has not seen (chunked to
        the step budget), each later one the previous round's drafts."""
        live = []
        for st, k in items:
            st.drafts, st.tops, st.want = [], [], k
            if self._sync(st, k):
                live.append(st)
        while live:
            sched, left = [], self.max_num_batched_tokens
            for st in live:
                n = min(len(st.token_ids) - st.num_computed_tokens, left)
                if n < 1:
                    break
                sched.append(ScheduledSeq(st, n, st.num_computed_tokens))
                left -= n
            rows = [s.seq for s in sched if s.samples]
            batch = draft_batch(rows, self.eos_token_ids, self.masks) if rows else None
            inp = build_step_inputs(self.step_id, sched, self.runner.block_size, batch)
            self.step_id += 1
            out = self.runner.execute_step(inp)
            out.wait()
            for s in sched:
                s.seq.num_computed_tokens = s.start + s.num_tokens
            done = set()
            lps = out.logprobs_host if batch is not None and batch.max_logprobs else None
            for r, (st, tok) in enumerate(zip(rows, out.tokens)):
                if not is_legal(batch, r, tok):     # every token masked: nothing to draft
                    done.add(id(st))
                    continue
                st.drafts.append(tok)
                if lps is not None and st.seq.watch is not None:
                    st.tops.append((tuple(int(i) for i in lps[1][r]),
                                    tuple(round(math.exp(float(v)), 6) for v in lps[2][r])))
                if len(st.drafts) < st.want and tok not in st.stop_ids():
                    st.token_ids.append(tok)        # fed in the next round
                else:
                    done.add(id(st))
            live = [st for st in live if id(st) not in done]
        for st, _ in items:
            # blocks for the K/V held: the context and every draft but the last (fewer when
            # drafting stopped early)
            self.block_manager.truncate(st, st.num_computed_tokens)
            st.prefetched = (len(st.seq.token_ids), st.drafts, st.tops)

    def _sync(self, st: DraftSeq, k: int) -> bool:
        """Cut st's cache back to the longest prefix it shares with its request (always
        recomputing the request's newest token, whose logits give the first draft), take
        blocks for the context and k - 1 drafts, and queue the unseen tokens. False when the
        draft's cache has no room (no drafts this step: the target decodes plainly)."""
        ids, L = st.seq.token_ids, len(st.seq.token_ids)
        lim = min(st.num_computed_tokens, L - 1)
        j = min(st.base, lim)
        while j < lim and st.token_ids[j] == ids[j]:
            j += 1
        self._truncate(st, j)
        self.live[id(st)] = st
        if not self.block_manager.can_append(st, L + k - 1):
            return False
        self.block_manager.append_slots(st, L + k - 1)
        st.token_ids.extend(ids[j:L])
        st.base = L
        return True

    # ---- rollback and release --------------------------------------------------------------
    def _truncate(self, st: DraftSeq, n: int) -> None:
        n = min(n, st.num_computed_tokens)
        del st.token_ids[n:]
        st.num_computed_tokens = n
        st.base = min(st.base, n)
        self.block_manager.truncate(st, n)

    def rollback(self, st: DraftSeq, num_tokens: int) -> None:
        """Keep the K/V of the request's first num_tokens tokens (all verified)."""
        self._truncate(st, num_tokens)
        st.base = st.num_computed_tokens

    def release(self, st: DraftSeq) -> None:
        if self.block_manager is not None:
            self._truncate(st, 0)
        st.prefetched = None
        self.live.pop(id(st), None)

    def check_invariants(self) -> None:
        """The block manager's own, over the requests holding draft blocks (tests)."""
        self.block_manager.check_invariants(list(self.live.values()))

    def shutdown(self) -> None:
        self.runner.shutdown()


def load_draft(config, spec, target_hf_config, target_tokenizer, eos_token_ids,
               max_model_len: int, kernel_config) -> DraftModel:
    """Load spec.model as the draft of a target (its hf_config, tokenizer): InvalidArgumentError
    naming speculative_config.model when it cannot load or does not share the vocabulary."""
    from ..checkpoint import Checkpoint
    from ..errors import ModelLoadError
    from ..model_runner import ModelRunner
    path = spec.model
    try:
        ckpt = Checkpoint.load(path)
    except (ModelLoadError, InvalidArgumentError, OSError) as e:
        raise InvalidArgumentError(f"{FIELD}={path!r} cannot be loaded as a draft model: {e}",
                                   FIELD) from None
    check_same_vocabulary(path, ckpt.hf_config, ckpt.tokenizer, target_hf_config,
                          target_tokenizer)
    import dataclasses
    config = dataclasses.replace(config, tensor_parallel_size=1)    # unsharded, on rank 0
    try:
        ckpt.check_memory(config)
        runner = ModelRunner(config, ckpt.hf_config, ckpt.path, max_model_len,
                             kernel_config=kernel_config)
    except (ModelLoadError, InvalidArgumentError, OSError) as e:
        raise InvalidArgumentError(f"{FIELD}={path!r} cannot be loaded as a draft model: {e}",
                                   FIELD) from None
    return DraftModel(runner, eos_token_ids, config.max_num_batched_tokens)


def check_same_vocabulary(path: str, hf_config, tokenizer, target_hf_config,
                          target_tokenizer) -> None:
    """A draft proposes token ids the target reads as its own: the same vocabulary size (the
    logits' width) and, where the target has a tokenizer, the same token -> id mapping."""
    v, tv = hf_config.vocab_size, target_hf_config.vocab_size
    if v != tv:
        raise InvalidArgumentError(f"{FIELD}={path!r} has vocab_size {v}, the target {tv}: a "
                                   "draft must share the target's tokenizer and vocabulary; "
                                   "pick a smaller model of the same family", FIELD)
    if target_tokenizer is None:
        return
    if tokenizer is None:
        raise InvalidArgumentError(f"{FIELD}={path!r} has no tokenizer files, so it cannot be "
                                   "checked against the target's; add the target's tokenizer "
                                   "files to it", FIELD)
    if tokenizer.get_vocab() != target_tokenizer.get_vocab():
        raise InvalidArgumentError(f"{FIELD}={path!r} has a different tokenizer from the "
                                   "target's (token ids would mean other text); use a draft "
                                   "of the same family, with the same tokenizer", FIELD)
