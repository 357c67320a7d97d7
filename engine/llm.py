"""LLM: the public API. generate / stream / abort / inspect / trace over a background engine
loop thread that batches every in-flight request together (continuous batching)."""
from __future__ import annotations

import atexit
import itertools
import json
import numbers
import os
import queue
import random
import threading
import time
import weakref
from typing import Callable

from .generation_lock import GenerationLock
from .snapshot_handoff import SnapshotHandoff, without_gc
from .block_manager import BlockManager
from .config import EngineConfig
from .engine_core import EngineCore
from .errors import (EngineFailedError, EngineShutdownError, InvalidArgumentError,
                     PromptTooLongError, RequestFailedError)
from .loader import resolve_model_path
from .probes.spec import ProbeSpec
from .sampling_params import SamplingParams
from .scheduler import Scheduler
from .records import BlockInfo, EngineSnapshot, KVLayout
from .snapshot import build_snapshot, copy_state
from .sequence import RequestOutput, Sequence, TokenEvent

_engine_ids = itertools.count()
_running: "weakref.WeakSet[LLM]" = weakref.WeakSet()     # engines whose loop thread may run


MAX_NOTE = 200      # characters of LLM.annotate's note kept (a row, not a log)
MAX_STEP_FAILURES = 3   # steps failing in a row, each failing what was in flight, end the engine


@atexit.register
def _shutdown_at_exit() -> None:
    """Stop every engine still running when the interpreter exits. The loop thread is a daemon,
    and a daemon thread caught inside a torch call by the interpreter's teardown aborts the
    process: Python < 3.14 ends it with pthread_exit when the call returns and retakes the GIL,
    and that unwinding through pybind11's GIL guard (a noexcept destructor) calls
    std::terminate — "terminate called without an active exception", exit status 134, after
    the program itself had finished."""
    for llm in list(_running):
        try:
            llm.shutdown()
        except Exception:   # noqa: BLE001 — exiting anyway: the next engine must still stop
            pass


def _load_hf_config(path: str):
    """config.json -> the transformers config, never running code shipped in the checkpoint."""
    from transformers import AutoConfig

    from .errors import CheckpointFormatError, UnsupportedArchitectureError
    from .models.registry import model_class, supported_architectures
    file = os.path.join(path, "config.json")
    try:
        with open(file, encoding="utf-8") as f:
            raw = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointFormatError(f"{file} is not valid JSON: {e}; fix or replace the "
                                    "checkpoint's config.json") from None
    except OSError as e:
        raise CheckpointFormatError(f"cannot read {file}: {e}") from None
    if not isinstance(raw, dict):
        raise CheckpointFormatError(f"{file} must hold a JSON object (the model's settings), "
                                    f"got a JSON {type(raw).__name__}")
    from .model_size import check_config_sizes
    try:
        check_config_sizes(raw, file)        # before transformers builds per-layer lists
    except ValueError as e:
        raise CheckpointFormatError(str(e)) from None
    try:
        cfg = AutoConfig.from_pretrained(path, trust_remote_code=False)
    except (ValueError, KeyError, OSError) as e:
        remote = raw.get("auto_map") and "trust_remote_code" in str(e)
        why = ("it maps its model_type to Python code in the checkpoint (auto_map), and "
               "Glassbox never runs code from a checkpoint" if remote else f"{e}")
        raise UnsupportedArchitectureError(
            f"architecture {raw.get('architectures')} (model_type {raw.get('model_type')!r}) "
            f"cannot be loaded: {why}. Supported: {', '.join(supported_architectures())}") from None
    model_class(cfg)            # raises UnsupportedArchitectureError with a clear message
    return cfg


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def _load_tokenizer(path: str):
    """The checkpoint's tokenizer, None when it has no tokenizer files (token-id prompts only);
    never one defined by code shipped in the checkpoint."""
    if not any(os.path.exists(os.path.join(path, f)) for f in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    from .errors import CheckpointFormatError
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    except Exception as e:
        try:
            with open(os.path.join(path, "tokenizer_config.json"), encoding="utf-8") as f:
                remote = "auto_map" in json.load(f)
        except (OSError, ValueError):
            remote = False
        why = ("its tokenizer_config.json maps the tokenizer to Python code in the checkpoint "
               "(auto_map), and Glassbox never runs code from a checkpoint" if remote
               else f"{type(e).__name__}: {e}")
        raise CheckpointFormatError(f"the tokenizer in {path} cannot be loaded: {why}. Use a "
                                    "checkpoint with a standard tokenizer (tokenizer.json), or "
                                    "remove the tokenizer files to serve token-id prompts only"
                                    ) from None


def _eos_ids(path: str, hf_config, tokenizer) -> set[int]:
    ids: set[int] = set()
    def add(v):
        if isinstance(v, int):
            ids.add(v)
        elif isinstance(v, (list, tuple)):
            ids.update(int(x) for x in v)
    gen = os.path.join(path, "generation_config.json")
    if os.path.exists(gen):
        from .errors import CheckpointFormatError
        try:
            with open(gen, encoding="utf-8") as f:
                raw = json.load(f)
            if not isinstance(raw, dict):
                raise ValueError(f"it holds a JSON {type(raw).__name__}, not an object")
            add(raw.get("eos_token_id"))
        except (ValueError, TypeError, OSError) as e:  # JSONDecodeError, bad ids, unreadable
            raise CheckpointFormatError(
                f"{gen} is not a valid generation config: {e}; fix it (eos_token_id must be an "
                "integer or a list of integers) or remove the file") from None
    add(getattr(hf_config, "eos_token_id", None))
    if tokenizer is not None:
        add(tokenizer.eos_token_id)
    return ids


def _is_token_id(t) -> bool:
    return isinstance(t, numbers.Integral) and not isinstance(t, bool)


def _is_conversation(prompt) -> bool:
    """A list of chat messages (dicts), as opposed to a list of prompts."""
    return isinstance(prompt, (list, tuple)) and bool(prompt) and isinstance(prompt[0], dict)


# The engine's thread shares the GIL with everything else in the process: the playground's
# handlers, the API's event loop. CPython makes a thread that wants the GIL wait up to the
# switch interval (5 ms by default) before the holder is told to let go, and a decode step's
# host work is ~0.5 ms: each such wait would stall the device for several steps. A 0.2 ms
# interval bounds that wait at a fraction of a step (the cost: more frequent switches between
# threads that all want to run, ~µs each). GLASSBOX_SWITCH_INTERVAL_S overrides it.
GIL_SWITCH_INTERVAL_S = 2e-4


def _shorten_gil_switch_interval() -> None:
    import sys
    want = float(os.environ.get("GLASSBOX_SWITCH_INTERVAL_S") or GIL_SWITCH_INTERVAL_S)
    if want > 0 and sys.getswitchinterval() > want:
        sys.setswitchinterval(want)


def _weak_call(obj, method: str):
    """obj.method as a callable that holds no strong reference to obj (a bound method kept by
    an object obj owns is a cycle, which outlives a model switch once the next engine's
    gc.freeze() keeps it)."""
    import weakref
    ref = weakref.ref(obj)

    def call():
        o = ref()
        if o is not None:
            getattr(o, method)()
    return call


class LLM:
    def __init__(self, model: str, device=None, dtype=None, tensor_parallel_size: int = 1,
                 block_size: int = 16, num_kv_blocks: int | None = None,
                 gpu_memory_utilization: float = 0.9, max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 8192, max_model_len: int | None = None,
                 enable_prefix_caching: bool = True, enforce_eager: bool = False, seed: int = 0,
                 load_format: str = "auto", trace_history: int = 256,
                 record_expert_load: bool = False, max_traces: int = 64,
                 async_scheduling: bool | None = None):
        self.config = cfg = EngineConfig(
            model=model, device=device, dtype=dtype, tensor_parallel_size=tensor_parallel_size,
            block_size=block_size, num_kv_blocks=num_kv_blocks,
            gpu_memory_utilization=gpu_memory_utilization, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
            enable_prefix_caching=enable_prefix_caching, enforce_eager=enforce_eager, seed=seed,
            load_format=load_format, trace_history=trace_history)
        self.model_path = resolve_model_path(model)
        self.hf_config = _load_hf_config(self.model_path)
        self.tokenizer = _load_tokenizer(self.model_path)
        self.eos_token_ids = _eos_ids(self.model_path, self.hf_config, self.tokenizer)
        limit = getattr(self.hf_config, "max_position_embeddings", None) or 4096
        if max_model_len is not None and max_model_len > limit:
            raise InvalidArgumentError(f"max_model_len={max_model_len} exceeds the model's "
                                       f"max_position_embeddings={limit}; use at most {limit}",
                                       "max_model_len")
        self.max_model_len = max_model_len or limit
        self.engine_id = next(_engine_ids)
        self._rng = random.Random(seed)
        self._ids = itertools.count()

        if cfg.device.startswith("cuda"):      # refuse what cannot fit before allocating
            import torch

            from .model_size import check_fits
            check_fits(self.hf_config, cfg.tensor_parallel_size,
                       torch.empty(0, dtype=cfg.torch_dtype).element_size(),
                       torch.cuda.get_device_properties(0).total_memory,
                       cfg.gpu_memory_utilization, str(cfg.torch_dtype).replace("torch.", ""))
        else:                                   # the host's memory, the same way
            import torch

            from .model_size import check_fits_host
            check_fits_host(self.hf_config, torch.empty(0, dtype=cfg.torch_dtype).element_size(),
                            str(cfg.torch_dtype).replace("torch.", ""))
        from .runtime import build_runner
        self.runner = build_runner(cfg, self.hf_config, self.model_path, self.max_model_len)
        # a fact of the checkpoint, kept past shutdown() (which frees the weights): the app's
        # model line still describes the old engine while a switch loads the next one
        self._num_params = self.runner.num_params
        num_blocks = num_kv_blocks or self.runner.profile_num_blocks(
            cfg.max_num_batched_tokens, cfg.max_num_seqs)
        self.runner.allocate_kv_cache(num_blocks)
        # a sequence can never hold more tokens than the whole cache
        self.max_model_len = min(self.max_model_len, num_blocks * block_size)
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs, max_num_batched_tokens,
                                   self.max_model_len, self.eos_token_ids)
        from .probes.manager import ProbeManager
        # expert load per step is a global aggregate (every request, watched or not): off by
        # default so an unwatched engine does no probe work; the playground turns it on
        self.probes = ProbeManager(
            self.hf_config.num_hidden_layers, block_size, self.runner.moe_layers,
            self.tokenizer.decode if self.tokenizer is not None else None,
            max_traces=max_traces, record_expert_load=bool(record_expert_load))
        self.runner.capture_graphs(max_num_seqs)
        # facts a snapshot reports that never change while this engine lives: computed once,
        # not under the lock at every inspect()
        kv = self.runner.kv_cache
        per_block = self.runner.bytes_per_block
        self.kv_layout = KVLayout(tuple(kv.shape), str(kv.dtype).replace("torch.", ""),
                                  per_block, per_block // block_size,
                                  kv.numel() * kv.element_size())
        self.tp_layout = self.runner.tp_layout()
        self.moe_facts = None
        if self.runner.moe_layers:
            self.moe_facts = {"num_experts": self.hf_config.num_experts,
                              "top_k": self.hf_config.num_experts_per_tok,
                              "moe_layers": list(self.runner.moe_layers)}
        self.dtype_name = str(cfg.torch_dtype).replace("torch.", "")
        # how long inspect() / trace() held the engine lock, newest last (bench/watched.py):
        # wall seconds, and the reader thread's CPU seconds (the work itself, without the
        # time the OS or the GIL kept the thread waiting)
        from collections import deque
        self.lock_hold_s: dict[str, deque] = {"inspect": deque(maxlen=4096),
                                              "trace": deque(maxlen=4096)}
        self.lock_hold_cpu_s: dict[str, deque] = {"inspect": deque(maxlen=4096),
                                                  "trace": deque(maxlen=4096)}
        # overlap scheduling pays where the forward is asynchronous (a GPU); on the CPU the
        # forward blocks the host anyway, so each step is postprocessed right after its launch
        self.async_scheduling = (cfg.device.startswith("cuda") if async_scheduling is None
                                 else bool(async_scheduling))
        self._seqs: dict[str, Sequence] = {}
        # where each request's events go: a queue's put (generate/stream) or a caller's
        # on_event (submit); called on the engine thread, with the engine lock held
        self._sinks: dict[str, Callable[[object], None]] = {}
        # called with every request's final TokenEvent (engine thread, lock held: be quick)
        self.finish_listeners: list[Callable[[TokenEvent], None]] = []
        # counts the sections that may change state: an idle engine's snapshot is reused, lock-free
        self._lock = GenerationLock()
        self._kept = None           # (generation, copy_state()[1:]): the last reader-side copy
        self._wake = threading.Condition(self._lock)
        self.core = EngineCore(self.runner, self.scheduler, self.block_manager, self.tokenizer,
                               self.eos_token_ids, self.probes, trace_history,
                               overlap=self.async_scheduling, lock=self._lock)
        # while the engine is busy, readers' snapshots are copied by the engine thread at its
        # step boundaries (engine/snapshot_handoff.py): no reader holds the lock it needs
        self.snapshots = SnapshotHandoff()
        self.core.on_idle = _weak_call(self, "_serve_while_waiting")
        from .interventions.plan import InterventionPlanner
        from .interventions.spec import ModelFacts
        self.intervention_facts = ModelFacts.of(self.hf_config, self.runner.moe_layers,
                                                  self.max_model_len)
        self.core.interventions = InterventionPlanner(self.intervention_facts)
        self._stop = False
        self._error: BaseException | None = None    # an engine-wide failure (e.g. a dead worker)
        self._step_failures = 0     # steps in a row that failed outside one request's data
        _shorten_gil_switch_interval()
        # everything built so far (modules, tensors' wrappers, the tokenizer, 65k block
        # records) lives as long as the engine: out of the collector's reach, a full
        # collection no longer walks it, in the engine's steps or under its lock
        import gc
        gc.freeze()         # O(1): a splice of the collector's lists (app.py collects first)
        self._thread = threading.Thread(target=self._loop, name=f"glassbox-engine-{self.engine_id}",
                                        daemon=True)
        self._thread.start()
        _running.add(self)

    # ---- model facts ---------------------------------------------------------------------------
    @property
    def model_name(self) -> str:
        return os.path.basename(os.path.normpath(self.model_path))

    @property
    def architecture(self) -> str:
        return self.hf_config.architectures[0]

    @property
    def num_params(self) -> int:
        return self._num_params

    @property
    def dtype(self):
        return self.config.torch_dtype

    @property
    def device(self) -> str:
        return self.config.device

    @property
    def tp_size(self) -> int:
        return self.config.tensor_parallel_size

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def num_kv_blocks(self) -> int:
        return self.block_manager.num_blocks

    # ---- input checks ----------------------------------------------------------------------------
    def encode(self, prompt) -> list[int]:
        """The token ids the engine runs for `prompt` (a string, token ids, or chat messages);
        a ValueError for a prompt it refuses. The API counts and checks prompts with it."""
        return self._encode(prompt)[0]

    def _encode(self, prompt) -> tuple[list[int], str | None]:
        from .prompt import check_prompt_chars, check_text, conversation_chars
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidArgumentError(f"{self.model_path} has no tokenizer; pass token-id "
                                           "lists", "prompt")
            if not prompt:
                raise InvalidArgumentError("prompt is empty: give at least one character or "
                                           "token", "prompt")
            check_prompt_chars(len(prompt), self.max_model_len)     # before tokenizing
            check_text(prompt)
            return self.tokenizer.encode(prompt, add_special_tokens=False), prompt
        if _is_conversation(prompt):
            if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
                raise InvalidArgumentError("this checkpoint has no chat template; pass a plain "
                                           "prompt", "prompt")
            from .prompt import encode_chat     # message text stays text: no role injection
            check_prompt_chars(conversation_chars(prompt), self.max_model_len)
            for i, m in enumerate(prompt):
                if isinstance(m, dict) and isinstance(m.get("content"), str):
                    check_text(m["content"], f"messages[{i}].content")
            return encode_chat(self.tokenizer, list(prompt))
        if isinstance(prompt, (list, tuple)):
            if len(prompt) >= self.max_model_len:       # before checking every id
                raise self._too_long(len(prompt))
            bad = [t for t in prompt if not _is_token_id(t)]
            if bad:
                raise InvalidArgumentError(f"prompt token ids must be integers, got {bad[0]!r} "
                                           f"({type(bad[0]).__name__})", "prompt")
            return [int(t) for t in prompt], None
        raise InvalidArgumentError(f"prompt must be a string, a list of token ids or a list of "
                                   f"chat messages, got {type(prompt).__name__}", "prompt")

    def _too_long(self, n: int) -> PromptTooLongError:
        """The error for a prompt of n tokens that can never fit with one new token."""
        cache_tokens = self.num_kv_blocks * self.block_size
        why = (f"the KV cache holds only {cache_tokens} tokens ({self.num_kv_blocks} blocks "
               f"x {self.block_size}); raise num_kv_blocks (or gpu_memory_utilization)"
               if self.max_model_len == cache_tokens else
               f"max_model_len is {self.max_model_len}; raise max_model_len")
        return PromptTooLongError(f"prompt has {n} tokens and can never fit with at least one "
                                  f"new token: {why}, or shorten the prompt")

    def _make_sequence(self, prompt, params: SamplingParams | None, watch: ProbeSpec | None,
                       request_id: str | None, interventions=None,
                       cache_salt: str | None = None) -> tuple[Sequence, str | None]:
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise InvalidArgumentError(f"sampling must be a SamplingParams or None, "
                                       f"got {type(params).__name__}", "sampling")
        if watch is not None and not isinstance(watch, ProbeSpec):
            raise InvalidArgumentError(f"watch must be a ProbeSpec or None, got "
                                       f"{type(watch).__name__}", "watch")
        vocab = self.hf_config.vocab_size
        params.check_for_model(vocab)           # frozen: what is checked is what runs
        if watch is not None:                   # negative layers resolved, out of range refused
            watch = watch.resolve(self.hf_config.num_hidden_layers, vocab)
        from .cache_salt import chain_root, check_salt
        from .interventions.spec import cache_salt as interventions_salt, resolve_interventions
        salt = check_salt(cache_salt)
        ivs = resolve_interventions(interventions, self.intervention_facts)
        ids, text = self._encode(prompt)
        if not ids:
            raise InvalidArgumentError("prompt is empty: give at least one character or token",
                                       "prompt")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise InvalidArgumentError(f"token ids {bad[:5]} are outside the vocabulary "
                                       f"[0, {vocab})", "prompt")
        if len(ids) >= self.max_model_len:
            raise self._too_long(len(ids))
        rid = request_id or f"req-{self.engine_id}-{next(self._ids)}"
        if rid in self._seqs:
            raise InvalidArgumentError(f"request id {rid!r} is already in use; give a new one "
                                       "(or None for a generated id)", "request_id")
        seed = params.seed if params.seed is not None else self._rng.getrandbits(62)
        seq = Sequence(rid, ids, params, seed, watch)
        seq.interventions, seq.cache_salt = ivs, chain_root(interventions_salt(ivs), salt)
        if params.guided is not None:       # a bad grammar is refused here, before queueing
            from .guided import make_matcher
            seq.grammar = make_matcher(self.tokenizer, vocab, self.eos_token_ids, params.guided)
        return seq, text

    # ---- the engine loop -----------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._stop and not self.core.has_work():
                    self._wake.wait()
                if self._stop:
                    return
            # the step takes the lock only while it changes engine state: not during the
            # forward or while waiting for the device, so inspect/abort/submit never starve
            try:
                result = self.core.step()
                self._step_failures = 0
            except BaseException as e:
                # a step failed outside what one request's data explains: fail what is in
                # flight, and go on serving; a dead worker, or steps that keep failing, end
                # the engine (every later request would fail the same way)
                self._step_failures += 1
                fatal = (isinstance(e, EngineFailedError) or not isinstance(e, Exception)
                         or self._step_failures >= MAX_STEP_FAILURES)
                with self._lock:
                    if fatal:
                        self._error = e
                        self._fail_all(e)
                    else:
                        self._fail_all(RequestFailedError(
                            f"an engine step failed while this request was in it: {e!r}"))
                continue
            with self._lock:
                for rid, err in result.failures:        # one request's own failure
                    self._fail_one(rid, err)
                for ev in result.events:
                    self._deliver(ev)
                if self.snapshots.wanted:               # a reader waits for a copy
                    self.snapshots.serve(self._copy_state)
            # between steps: give waiting threads the lock; CPython locks are not fair
            time.sleep(0)

    def _deliver(self, ev: TokenEvent) -> None:
        sink = self._sinks.get(ev.request_id)
        if ev.finished:
            self._sinks.pop(ev.request_id, None)
            self._seqs.pop(ev.request_id, None)
            for listener in self.finish_listeners:     # e.g. the API's /metrics histograms
                self._call_sink(listener, ev)
        if sink is not None:
            self._call_sink(sink, ev)

    @staticmethod
    def _call_sink(sink, item) -> None:
        try:
            sink(item)
        except Exception:   # noqa: BLE001 — a consumer's bug must not stop the engine loop
            import logging
            logging.getLogger("glassbox").exception("a request's on_event callback raised")

    def _fail_one(self, rid: str, err: BaseException) -> None:
        seq = self._seqs.pop(rid, None)
        if seq is not None and not seq.is_finished:
            self.scheduler.finish(seq, "abort")
        sink = self._sinks.pop(rid, None)
        if sink is not None:
            self._call_sink(sink, err)

    def _fail_all(self, err: BaseException) -> None:
        self.core.inflight = None
        for rid in list(self._seqs):
            self._fail_one(rid, err)
        self.core.detok.clear()

    def _submit(self, seq: Sequence, sink: Callable[[object], None] | None = None
                ) -> queue.Queue | None:
        q: queue.Queue | None = None
        if sink is None:
            q = queue.Queue()
            sink = q.put
        with self._wake:
            if self._stop or not self._thread.is_alive():
                raise EngineShutdownError("the engine has been shut down; create a new LLM")
            if self._error is not None:
                raise EngineFailedError(f"the engine failed ({self._error!r}) and cannot serve "
                                        "requests; create a new LLM") from self._error
            self._seqs[seq.request_id] = seq
            self._sinks[seq.request_id] = sink
            self.probes.register(seq)
            self.core.add(seq)
            self._wake.notify()
        return q

    @staticmethod
    def _next(q: queue.Queue) -> TokenEvent:
        ev = q.get()
        if isinstance(ev, (RequestFailedError, EngineShutdownError)):
            raise ev
        if isinstance(ev, BaseException):
            raise EngineFailedError(f"the engine failed while running this request: {ev!r}"
                                    ) from ev
        return ev

    # ---- public API ------------------------------------------------------------------------------
    def generate(self, prompts, sampling=None, use_tqdm: bool = False,
                 watch=None, interventions=None, cache_salt: str | None = None
                 ) -> list[RequestOutput]:
        if isinstance(prompts, str) or _is_conversation(prompts) or (
                isinstance(prompts, (list, tuple)) and prompts and _is_token_id(prompts[0])):
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
        ivs = per_prompt(interventions, n)      # one list for all prompts, or one per prompt
        made = [self._make_sequence(p, s, w, None, i, cache_salt)
                for p, s, w, i in zip(prompts, params, watches, ivs)]
        with self._wake:        # all at once: the batch's prompts are scheduled together
            queues = [self._submit(seq) for seq, _ in made]
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm
            bar = tqdm(total=n, desc="generate")
        outs = []
        for (seq, text), q in zip(made, queues):
            while not self._next(q).finished:
                pass
            if bar is not None:
                bar.update(1)
            outs.append(RequestOutput(seq.request_id, text, seq.prompt_token_ids,
                                      seq.output_token_ids, seq.output_text, seq.finish_reason,
                                      seq.logprobs, seq.metrics(), seq.prompt_logprobs))
        if bar is not None:
            bar.close()
        return outs

    def stream(self, prompt, sampling: SamplingParams | None = None, watch: ProbeSpec | None = None,
               request_id: str | None = None, interventions=None, cache_salt: str | None = None):
        """Yield TokenEvents as tokens are produced. Closing the generator aborts the request."""
        seq, _ = self._make_sequence(prompt, sampling, watch, request_id, interventions,
                                     cache_salt)
        q = self._submit(seq)
        finished = False
        try:
            while True:
                ev = self._next(q)
                finished = ev.finished
                yield ev
                if finished:
                    return
        finally:
            if not finished:
                self.abort(seq.request_id)

    def submit(self, prompt, sampling: SamplingParams | None = None,
               watch: ProbeSpec | None = None, request_id: str | None = None, *,
               on_event: Callable[[object], None], interventions=None,
               cache_salt: str | None = None) -> str:
        """Start a request without a thread waiting on it; returns its id. `on_event` is called
        on the engine thread with each TokenEvent (the last has finished=True), or once with an
        exception if the request fails. It must return quickly and never block (append to a
        queue, wake an event loop): it runs inside the step loop, with the engine lock held.
        A bad prompt raises here, before anything is queued. Stop it with `abort`."""
        seq, _ = self._make_sequence(prompt, sampling, watch, request_id, interventions,
                                     cache_salt)
        self._submit(seq, on_event)
        return seq.request_id

    def prepare(self, prompt, sampling: SamplingParams | None = None,
                watch: ProbeSpec | None = None, request_id: str | None = None,
                interventions=None, cache_salt: str | None = None) -> Sequence:
        """`submit`'s first half: check and tokenize a request without queueing it (the slow
        part for a long prompt: a server does it on a worker pool of its own, and queues the
        result with `submit_prepared` from another, so starts and aborts never wait behind it)."""
        return self._make_sequence(prompt, sampling, watch, request_id, interventions,
                                   cache_salt)[0]

    def submit_prepared(self, seq: Sequence, *, on_event: Callable[[object], None]) -> str:
        """`submit`'s second half: queue a Sequence from `prepare` (fast: takes the lock)."""
        self._submit(seq, on_event)
        return seq.request_id

    def steering_vector(self, layer: int, prompt_a, prompt_b):
        """mean(resid_post of `layer` over prompt_a's tokens) - the same for prompt_b: a
        [hidden_size] fp32 tensor for Intervention.steer (interventions/steering.py)."""
        from .interventions.steering import steering_vector
        return steering_vector(self, layer, prompt_a, prompt_b)

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its KV blocks. False if it is unknown or done."""
        with self._wake:
            seq = self._seqs.get(request_id)
            if seq is None or seq.is_finished:
                return False
            self._deliver(self.core.abort(seq))
            return True

    def annotate(self, request_id: str, note: str) -> bool:
        """Attach a short note to a live request, shown in its playground row (the API puts
        the tool calls it has parsed so far there). False if the request is unknown or done."""
        if not isinstance(note, str):
            raise TypeError(f"a request's note must be a string, got {type(note).__name__}")
        with self._lock:
            seq = self._seqs.get(request_id)
            if seq is None or seq.is_finished:
                return False
            seq.annotation = note[:MAX_NOTE]
            return True

    def _check_open(self) -> None:
        if getattr(self, "_closed", False):
            raise EngineShutdownError("the engine has been shut down; create a new LLM")
    def stats(self) -> dict:
        """Engine-wide counters, cheap (no per-block copies): for /metrics and health checks."""
        with self._lock.reading():
            bm, sched = self.block_manager, self.scheduler
            return {"num_running": len(sched.running), "num_waiting": len(sched.waiting),
                    "kv_usage": (bm.num_blocks - bm.num_free_blocks) / bm.num_blocks,
                    "prefix_hits": bm.prefix_hits, "prefix_queries": bm.prefix_queries,
                    "num_preemptions": sched.num_preemptions, "block_size": bm.block_size,
                    "alive": not self._stop and self._error is None and self._thread.is_alive()}

    def _serve_while_waiting(self) -> None:
        """The engine thread waits for the device: a reader that asked meanwhile gets its copy
        now, not a whole (long: a big prefill) step later. The lock is free here: the step's
        changes are made before the launch and after the wait."""
        if self.snapshots.wanted:
            with self._lock.reading():
                if self.snapshots.wanted:
                    self.snapshots.serve(self._copy_state)

    def _copy_state(self):
        return copy_state(self)

    def _engine_busy(self) -> bool:
        """A step boundary is coming (read without the lock: a hint for SnapshotHandoff)."""
        return not self._stop and self._error is None and self.core.has_work()

    def inspect(self) -> EngineSnapshot:
        """A consistent snapshot of the engine (KV blocks as arrays, queues, recent steps),
        copied in O(requests): by the engine thread at its next step boundary while it is busy
        (the reader holds no lock), under the lock by the reader when the engine is idle, and
        handed out again without any lock while nothing has changed since that copy
        (engine/generation_lock.py). Looking never stalls the engine."""
        self._check_open()
        if threading.current_thread() is not self._thread:
            state = self.snapshots.take(self._engine_busy)
            if state is not None:
                return build_snapshot(state)
        kept = self._kept
        if kept is not None and kept[0] == self._lock.generation:
            # nothing has entered a writer's section since that copy: it is still the state
            self.snapshots.reused += 1
            return build_snapshot((self, *kept[1]))
        with self._lock.reading():
            t0, c0 = time.perf_counter(), time.thread_time()
            self._check_open()
            gen = self._lock.generation
            state = without_gc(copy_state, self)
            self._held("inspect", t0, c0)
        self._kept = (gen, state[1:])       # without the engine itself: no reference cycle
        return build_snapshot(state)

    def _held(self, what: str, t0: float, c0: float) -> None:
        self.lock_hold_s[what].append(time.perf_counter() - t0)
        self.lock_hold_cpu_s[what].append(time.thread_time() - c0)

    def trace(self, request_id: str):
        """The RequestTrace of a watched request, complete so far, as a frozen copy that the
        engine never changes afterwards (read it again for newer rows). KeyError if the
        request was never watched, or its trace was evicted (only the newest `max_traces`
        are kept). Reference copies of the rows under the lock; new tokens' texts are decoded
        after it; attention rows still on the device move to the host when a reader first uses
        one (`AttentionStep.probs`), one token at a time."""
        with self._lock.reading():
            t0, c0 = time.perf_counter(), time.thread_time()
            tr = self.probes.read(request_id)
            self._held("trace", t0, c0)
        start = len(tr.token_texts)
        new = self.probes.decode_texts(tr)       # the tokenizer runs with no lock held
        if new:
            with self._lock.reading():
                self.probes.keep_texts(request_id, start, new)
        return tr

    def steps_since(self, cursor: int = 0) -> tuple[tuple, int]:
        """(the step traces recorded since `cursor` that the bounded ring still holds, the new
        cursor): a reader that keeps its own longer history folds in only the new steps,
        O(new steps) under the lock. Start with cursor 0 (or a snapshot's `step_count`)."""
        with self._lock.reading():
            return self.core.steps.since(cursor)

    def block_info(self, block_id: int) -> BlockInfo:
        """One physical block now, with the token ids it holds and its prefix hash: read on
        demand for this block only (a hover card), under the lock in O(block_size)."""
        if not 0 <= int(block_id) < self.num_kv_blocks:
            raise ValueError(f"block_id must be in [0, {self.num_kv_blocks}), got {block_id}")
        b = int(block_id)
        with self._lock.reading():
            self._check_open()
            bm = self.block_manager
            seqs = self.scheduler.all_sequences() if bm.ref_count[b] > 0 else []
            owners = [s.request_id for s in seqs if b in s.block_table]
            ids = bm.block_token_ids(b, seqs)
            ref, h = int(bm.ref_count[b]), bm.blocks[b].prefix_hash
        return BlockInfo(b, ref, owners, len(ids), h, ref == 0 and h is not None, ids)

    def model_parts(self):
        """(model, kv_cache) of rank 0, for engine/anatomy to read the modules' structure and
        the cache's layout (both fixed while the engine lives). EngineShutdownError once the
        engine is shut down, e.g. by a model switch."""
        with self._lock.reading():
            self._check_open()
            return self.runner.model, self.runner.kv_cache

    def read_kv_bytes(self, offset: int, nbytes: int) -> bytes:
        """Raw bytes of rank 0's KV cache tensor from a byte offset (the Anatomy tab's view
        of one region), read between steps under the lock."""
        from .anatomy.kv_regions import read_cache_bytes
        with self._lock.reading():
            self._check_open()
            return read_cache_bytes(self.runner.kv_cache, offset, nbytes)

    def traced_requests(self) -> list[str]:
        """Request ids that have a trace, newest first."""
        with self._lock.reading():
            return list(reversed(self.probes.traces))

    def read_kv_block(self, block_id: int, layer: int, head: int, which: str = "k"):
        """K or V of one physical block for one layer and KV head: [block_size, head_dim]."""
        if which not in ("k", "v"):
            raise InvalidArgumentError("which must be 'k' or 'v'", "which")
        if not 0 <= block_id < self.num_kv_blocks:
            raise InvalidArgumentError(f"block_id must be in [0, {self.num_kv_blocks})", "block_id")
        if not 0 <= layer < self.hf_config.num_hidden_layers:
            raise InvalidArgumentError(f"layer must be in [0, {self.hf_config.num_hidden_layers})",
                                       "layer")
        with self._lock.reading():
            self._check_open()
            return self.runner.read_kv_block(block_id, layer, head, 0 if which == "k" else 1)

    def shutdown(self) -> None:
        """Stop the engine loop, fail every request still in flight at once (their streams
        raise EngineShutdownError), and free the weights, the KV cache and TP workers."""
        with self._wake:
            if self._stop and getattr(self, "_closed", False):
                return
            self._stop = True
            self._wake.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=30)
        with self._lock:
            self._fail_all(EngineShutdownError(
                "the engine was shut down while this request was in flight"))
            self._closed = True
        self.snapshots.clear()
        self._kept = None
        self.probes.release_device()
        self.runner.shutdown()
        import gc
        gc.unfreeze()       # what this engine kept frozen (see __init__) can be collected again
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()

    def __del__(self):
        try:
            if not self._stop:
                self.shutdown()
        except Exception:
            pass
