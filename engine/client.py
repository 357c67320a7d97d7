"""EngineClient: what the front ends (api/, views/) may use of an engine, and nothing more.
`LLM` implements it, and so do the tests' stand-ins (tests/scripted_engine.py): a front end
never probes an engine for what it has. Requests go in through `processor.process(...)` then
`submit`; the glass is read as immutable records, never a live engine structure.
"""
from __future__ import annotations

from typing import Callable, Protocol, runtime_checkable

from .processor import Processor
from .records import BlockInfo, EngineSnapshot
from .sequence import TokenEvent


@runtime_checkable
class EngineClient(Protocol):
    # ---- model facts (fixed while the engine lives) ----------------------------------------
    model_name: str                 # the checkpoint folder's name
    model_path: str | None
    architecture: str
    num_params: int
    device: str
    dtype: object                   # torch.dtype of the weights
    dtype_name: str
    tp_size: int
    block_size: int
    num_kv_blocks: int
    max_model_len: int
    hf_config: object               # transformers' config of the checkpoint
    tokenizer: object | None        # None: token-id prompts only
    eos_token_ids: set[int]
    moe_layers: tuple[int, ...]
    intervention_facts: object      # interventions.spec.ModelFacts
    processor: Processor

    # ---- requests -----------------------------------------------------------------------------
    def submit(self, prompt, sampling=None, watch=None, request_id: str | None = None, *,
               on_event: Callable[[object], None], interventions=None,
               cache_salt: str | None = None) -> str:
        """Queue a request (an EngineRequest from the processor, or what `process` takes)."""

    def stream(self, prompt, sampling=None, watch=None, request_id: str | None = None,
               interventions=None, cache_salt: str | None = None):
        """TokenEvents as they come; closing the generator aborts the request."""

    def generate(self, prompts, sampling=None, use_tqdm: bool = False, watch=None,
                 interventions=None, cache_salt: str | None = None) -> list:
        ...

    def abort(self, request_id: str) -> bool:
        ...

    def annotate(self, request_id: str, note: str) -> bool:
        ...

    @property
    def finish_listeners(self) -> list[Callable[[TokenEvent], None]]:
        """Called with every request's final TokenEvent, on the engine thread: be quick."""

    @property
    def step_listeners(self) -> list[Callable[[int], None]]:
        """Called with the token count of every engine step, on the engine thread."""

    def stats(self) -> dict:
        """Cheap counters: num_running, num_waiting, kv_usage, prefix_hits, prefix_queries,
        num_preemptions, block_size, alive; and spec_decode (draft and accepted token counts)
        where the engine speculates."""

    # ---- the glass ----------------------------------------------------------------------------
    def inspect(self) -> EngineSnapshot:
        ...

    def trace(self, request_id: str):
        ...

    def traced_requests(self) -> list[str]:
        ...

    def steps_since(self, cursor: int = 0) -> tuple[tuple, int]:
        ...

    def block_info(self, block_id: int, viewer_salt: str | None = None) -> BlockInfo:
        ...

    def read_kv_block(self, block_id: int, layer: int, head: int, which: str = "k"):
        ...

    def read_kv_bytes(self, offset: int, nbytes: int) -> bytes:
        ...

    def model_parts(self):
        ...

    def steering_vector(self, layer: int, prompt_a, prompt_b):
        ...

    def shutdown(self) -> None:
        ...
