"""LLM: the public Python API, a thin facade over Processor (checks and tokenizes a request),
EngineLoop (the engine thread stepping the EngineCore) and Inspector (snapshots, traces, KV reads).
Constructing an LLM changes nothing process-wide (engine/process_tuning.py is for servers).
"""
from __future__ import annotations

import atexit
import itertools
import os
import queue
import weakref
from functools import partial
from typing import Callable

from .block_manager import BlockManager
from .checkpoint import Checkpoint
from .config import EngineConfig
from .engine_core import EngineCore
from .engine_loop import EngineLoop
from .errors import EngineFailedError, EngineShutdownError, InvalidArgumentError, RequestFailedError
from .generation_lock import GenerationLock
from .inspector import Inspector
from .processor import EngineRequest, ModelLimits, Processor, is_conversation
from .records import EngineSnapshot, KVLayout
from .sampling_params import is_int
from .scheduler import Scheduler
from .sequence import RequestOutput, TokenEvent
from .snapshot import copy_state, engine_facts
from .snapshot_handoff import SnapshotHandoff
from .step_history import StepHistory

_engine_ids = itertools.count()
_running: "weakref.WeakSet[LLM]" = weakref.WeakSet()     # engines whose loop thread may run


@atexit.register
def _shutdown_at_exit() -> None:
    """Stop every engine still running when the interpreter exits. The loop thread is a daemon,
    and a daemon thread caught inside a torch call by the interpreter's teardown aborts the
    process (Python < 3.14 ends it with pthread_exit inside pybind11's GIL guard: "terminate
    called without an active exception", exit status 134, after the program had finished)."""
    for llm in list(_running):
        try:
            llm.shutdown()
        except Exception:   # noqa: BLE001 — exiting anyway: the next engine must still stop
            pass


class LLM:
    """`LLM(model, **settings)`: settings are EngineConfig's fields (engine/config.py), or pass
    an EngineConfig itself."""

    def __init__(self, model: str | EngineConfig, **settings):
        self.config = cfg = model if isinstance(model, EngineConfig) else \
            EngineConfig(model=model, **settings)
        ckpt = Checkpoint.load(cfg.model)
        self.model_path, self.hf_config, self.tokenizer = ckpt.path, ckpt.hf_config, ckpt.tokenizer
        self.eos_token_ids = set(ckpt.eos_token_ids)
        max_len = ckpt.max_model_len(cfg.max_model_len)
        self.engine_id = next(_engine_ids)
        ckpt.check_memory(cfg)                  # refuse what cannot fit before allocating
        from .runtime import build_runner
        self.runner = runner = build_runner(cfg, self.hf_config, self.model_path, max_len)
        # model facts, fixed while the engine lives; num_params is kept past shutdown() (which
        # frees the weights): the app's model line describes the old engine during a switch
        self.num_params = runner.num_params
        self.model_name = os.path.basename(os.path.normpath(self.model_path))
        self.architecture = self.hf_config.architectures[0]
        self.dtype, self.device = cfg.torch_dtype, cfg.device
        self.dtype_name = str(cfg.torch_dtype).replace("torch.", "")
        self.tp_size, self.block_size = cfg.tensor_parallel_size, cfg.block_size
        # a draft model (speculative_config.model): loaded before the KV cache is sized, so the
        # target's budget sees its weights
        self.draft = self._load_draft(cfg, max_len)
        num_blocks = cfg.num_kv_blocks or runner.profile_num_blocks(
            cfg.max_num_batched_tokens, cfg.max_num_seqs)
        if self.draft is not None:
            if not cfg.num_kv_blocks and cfg.device.startswith("cuda"):
                # one memory budget, split so both caches hold the same number of tokens
                t, d = runner.bytes_per_block, self.draft.runner.bytes_per_block
                num_blocks = max(1, num_blocks * t // (t + d))
            self.draft.allocate(num_blocks)
        runner.allocate_kv_cache(num_blocks)
        # a sequence can never hold more tokens than the whole cache
        self.max_model_len = min(max_len, num_blocks * cfg.block_size)
        self.block_manager = BlockManager(num_blocks, cfg.block_size, cfg.enable_prefix_caching)
        self.num_kv_blocks = num_blocks
        self.scheduler = Scheduler(self.block_manager, cfg.max_num_seqs,
                                   cfg.max_num_batched_tokens, self.max_model_len,
                                   self.eos_token_ids)
        from .interventions.plan import InterventionPlanner
        from .interventions.spec import ModelFacts
        from .probes.manager import ProbeManager
        L = self.hf_config.num_hidden_layers
        # expert load per step is a global aggregate (every request, watched or not): off by
        # default so an unwatched engine does no probe work; the playground turns it on
        self.probes = ProbeManager(L, cfg.block_size, runner.moe_layers,
                                   self.tokenizer.decode if self.tokenizer is not None else None,
                                   max_traces=cfg.max_traces,
                                   record_expert_load=cfg.record_expert_load)
        runner.capture_graphs(cfg.max_num_seqs)
        if self.draft is not None:          # its decode rounds replay graphs too (GPU)
            self.draft.runner.capture_graphs(cfg.max_num_seqs)
        self.intervention_facts = ModelFacts.of(self.hf_config, runner.moe_layers,
                                                self.max_model_len)
        self.moe_layers = self.intervention_facts.moe_layers
        self.processor = Processor(self.tokenizer, self.eos_token_ids, ModelLimits(
            self.hf_config.vocab_size, L, self.max_model_len, num_blocks, cfg.block_size),
            self.intervention_facts, seed=cfg.seed)
        # overlap scheduling pays where the forward is asynchronous (a GPU); on the CPU the
        # forward blocks the host anyway, so each step is postprocessed right after its launch
        self.async_scheduling = (cfg.device.startswith("cuda") if cfg.async_scheduling is None
                                 else bool(cfg.async_scheduling))
        # counts the sections that may change state: an idle engine's snapshot is reused
        lock, steps, handoff = GenerationLock(), StepHistory(cfg.trace_history), SnapshotHandoff()
        copy = partial(copy_state, self.block_manager, self.scheduler, steps)
        self.core = EngineCore(runner, self.scheduler, self.block_manager, self.tokenizer,
                               self.eos_token_ids, steps, probes=self.probes,
                               interventions=InterventionPlanner(self.intervention_facts),
                               overlap=self.async_scheduling, lock=lock,
                               on_idle=lambda: handoff.serve_while_waiting(lock, copy),
                               speculative_config=cfg.speculative_config, draft=self.draft)
        self.loop = EngineLoop(self.core, self.probes, lock, f"glassbox-engine-{self.engine_id}",
                               between_steps=lambda: handoff.serve_if_wanted(copy))
        # called on the engine thread with the lock held (be quick): with every request's final
        # TokenEvent, and with the token count of every step
        self.finish_listeners = self.loop.finish_listeners
        self.step_listeners = self.loop.step_listeners
        self.inspector = Inspector(self.loop, self._facts(num_blocks), self.block_manager,
                                   self.scheduler, steps, self.probes, runner, L, handoff)
        _running.add(self)

    def _load_draft(self, cfg, max_len: int):
        """The draft model of speculative_config (engine/spec_decode/draft_model.py), or None."""
        spec = cfg.speculative_config
        if spec is None or spec.method != "draft_model":
            return None
        from .spec_decode.draft_model import load_draft
        try:
            return load_draft(cfg, spec, self.hf_config, self.tokenizer, self.eos_token_ids,
                              max_len, self.runner.kernel_config)
        except BaseException:
            self.runner.shutdown()          # the target's weights (and TP workers) go too
            raise

    def _facts(self, num_blocks: int):
        kv, per_block, bs = self.runner.kv_cache, self.runner.bytes_per_block, self.block_size
        moe = None
        if self.runner.moe_layers:
            moe = {"num_experts": self.hf_config.num_experts,
                   "top_k": self.hf_config.num_experts_per_tok,
                   "moe_layers": list(self.runner.moe_layers)}
        c = self.hf_config
        return engine_facts(
            self.model_name, self.architecture, self.num_params, self.dtype_name, self.device,
            self.tp_size, bs, num_blocks,
            KVLayout(tuple(kv.shape), str(kv.dtype).replace("torch.", ""), per_block,
                     per_block // bs, kv.numel() * kv.element_size()),
            self.runner.tp_layout(), moe, c.num_hidden_layers, c.num_attention_heads,
            c.num_key_value_heads, self.async_scheduling)

    # ---- requests ------------------------------------------------------------------------------
    def encode(self, prompt) -> list[int]:
        """The token ids the engine runs for `prompt` (a string, token ids, or chat messages);
        an InvalidArgumentError for a prompt it refuses."""
        return list(self.processor.tokenize(prompt).token_ids)

    def process(self, prompt, sampling=None, watch=None, request_id: str | None = None, *,
                interventions=None, cache_salt: str | None = None,
                chat_options: dict | None = None) -> EngineRequest:
        """Check and tokenize a request without queueing it (the slow part for a long prompt:
        a server runs it on a worker pool of its own, then `submit`s the EngineRequest)."""
        return self.processor.process(prompt, sampling, watch=watch, request_id=request_id,
                                      interventions=interventions, cache_salt=cache_salt,
                                      chat_options=chat_options)

    def _request(self, prompt, sampling, watch, request_id, interventions, cache_salt):
        if isinstance(prompt, EngineRequest):
            return prompt
        return self.process(prompt, sampling, watch, request_id, interventions=interventions,
                            cache_salt=cache_salt)

    def submit(self, prompt, sampling=None, watch=None, request_id: str | None = None, *,
               on_event: Callable[[object], None], interventions=None,
               cache_salt: str | None = None) -> str:
        """Start a request without a thread waiting on it; returns its id. `prompt` may be an
        EngineRequest from `process` (queued as it is). `on_event` is called on the engine
        thread with each TokenEvent (the last has finished=True), or once with an exception if
        the request fails: it must return quickly and never block. A bad request raises here,
        before anything is queued. Stop it with `abort`."""
        req = self._request(prompt, sampling, watch, request_id, interventions, cache_salt)
        self.loop.add([req], [on_event])
        return req.request_id

    def stream(self, prompt, sampling=None, watch=None, request_id: str | None = None,
               interventions=None, cache_salt: str | None = None):
        """Yield TokenEvents as tokens are produced. Closing the generator aborts the request."""
        req = self._request(prompt, sampling, watch, request_id, interventions, cache_salt)
        q: queue.Queue = queue.Queue()
        self.loop.add([req], [q.put])
        finished = False
        try:
            while not finished:
                ev = _next(q)
                finished = ev.finished
                yield ev
        finally:
            if not finished:
                self.abort(req.request_id)

    def generate(self, prompts, sampling=None, use_tqdm: bool = False, watch=None,
                 interventions=None, cache_salt: str | None = None) -> list[RequestOutput]:
        """Outputs of every prompt (one, or a list; sampling / watch / interventions: one for
        all or one per prompt), scheduled together; built from each request's events."""
        if isinstance(prompts, str) or is_conversation(prompts) or (
                isinstance(prompts, (list, tuple)) and prompts and is_int(prompts[0])):
            prompts = [prompts]             # one prompt: a string, token ids, a conversation
        if not isinstance(prompts, (list, tuple)):
            raise InvalidArgumentError(f"prompts must be a string, a list of token ids, a list "
                                       f"of chat messages, or a list of those; got "
                                       f"{type(prompts).__name__}", "prompts")
        n = len(prompts)
        params = sampling if isinstance(sampling, (list, tuple)) else [sampling] * n
        watches = watch if isinstance(watch, (list, tuple)) else [watch] * n
        if len(params) != n or len(watches) != n:
            raise InvalidArgumentError(f"got {n} prompts but {len(params)} sampling params / "
                                       f"{len(watches)} watch specs; give one, or one per prompt",
                                       "sampling" if len(params) != n else "watch")
        from .interventions.spec import per_prompt
        reqs = [self.process(p, s, w, interventions=i, cache_salt=cache_salt)
                for p, s, w, i in zip(prompts, params, watches, per_prompt(interventions, n))]
        queues = [queue.Queue() for _ in reqs]
        self.loop.add(reqs, [q.put for q in queues])    # one batch: scheduled together
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm
            bar = tqdm(total=n, desc="generate")
        outs = [_collect(req, q, bar) for req, q in zip(reqs, queues)]
        if bar is not None:
            bar.close()
        return outs

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its KV blocks. False if it is unknown or done."""
        return self.loop.abort(request_id)

    def annotate(self, request_id: str, note: str) -> bool:
        """Attach a short note to a live request, shown in its playground row (the API puts
        the tool calls it has parsed so far there). False if the request is unknown or done."""
        return self.loop.annotate(request_id, note)

    def steering_vector(self, layer: int, prompt_a, prompt_b):
        """mean(resid_post of `layer` over prompt_a's tokens) - the same for prompt_b: a
        [hidden_size] fp32 tensor for Intervention.steer (interventions/steering.py)."""
        from .interventions.steering import steering_vector
        return steering_vector(self, layer, prompt_a, prompt_b)

    # ---- the glass (engine/inspector.py) -------------------------------------------------------
    def inspect(self) -> EngineSnapshot:
        return self.inspector.inspect()

    def trace(self, request_id: str):
        return self.inspector.trace(request_id)

    def traced_requests(self) -> list[str]:
        return self.inspector.traced_requests()

    def steps_since(self, cursor: int = 0) -> tuple[tuple, int]:
        return self.inspector.steps_since(cursor)

    def block_info(self, block_id: int, viewer_salt: str | None = None):
        return self.inspector.block_info(block_id, viewer_salt)

    def read_kv_block(self, block_id: int, layer: int, head: int, which: str = "k"):
        return self.inspector.read_kv_block(block_id, layer, head, which)

    def read_kv_bytes(self, offset: int, nbytes: int) -> bytes:
        return self.inspector.read_kv_bytes(offset, nbytes)

    def model_parts(self):
        return self.inspector.model_parts()

    def stats(self) -> dict:
        return self.inspector.stats()

    # ---- life cycle ------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop the engine loop, fail every request still in flight at once (their streams
        raise EngineShutdownError), and free the weights, the KV cache and TP workers."""
        if self.loop.closed:
            return
        self.loop.shutdown()
        self.inspector.release()
        self.probes.release_device()
        self.runner.shutdown()
        if self.draft is not None:
            self.draft.shutdown()
        _running.discard(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()

    def __del__(self):
        try:
            self.shutdown()
        except Exception:   # noqa: BLE001 — half-built or already gone
            pass


def _next(q: queue.Queue) -> TokenEvent:
    ev = q.get()
    if isinstance(ev, (RequestFailedError, EngineShutdownError)):
        raise ev
    if isinstance(ev, BaseException):
        raise EngineFailedError(f"the engine failed while running this request: {ev!r}") from ev
    return ev


def _collect(req: EngineRequest, q: queue.Queue, bar=None) -> RequestOutput:
    """One request's RequestOutput from its events (the engine's Sequence is never read)."""
    ids, lps, prompt_lps, drafts = [], [], None, []
    while True:
        ev = _next(q)
        if ev.token_id is not None:
            ids.append(ev.token_id)
        if ev.draft is not None:
            drafts.append(ev.draft)
        if ev.logprobs is not None:
            lps.append(ev.logprobs)
        if ev.prompt_logprobs is not None:
            prompt_lps = ev.prompt_logprobs
        if ev.finished:
            break
    if bar is not None:
        bar.update(1)
    if prompt_lps is None and req.params.prompt_logprobs is not None:
        prompt_lps = [None] * len(req.prompt)
    return RequestOutput(req.request_id, req.prompt.text, list(req.prompt.token_ids), ids,
                         ev.output_text, ev.finish_reason, lps, ev.metrics or {}, prompt_lps,
                         drafts)
