"""Glassbox engine: a paged-KV Qwen inference engine whose internals can be watched."""
from .errors import (CheckpointFormatError, CheckpointMismatchError, ModelNotFoundError,
                     PromptTooLongError, UnsupportedArchitectureError, WorkerDiedError)
from .interventions.spec import Intervention
from .llm import LLM
from .probes.spec import ProbeSpec
from .sampling import SamplingParams
from .sequence import RequestOutput, TokenEvent
from .probes.snapshot import EngineSnapshot
from .probes.trace import RequestTrace

__all__ = ["LLM", "Intervention", "SamplingParams", "ProbeSpec", "RequestOutput", "TokenEvent", "EngineSnapshot",
           "RequestTrace", "PromptTooLongError", "UnsupportedArchitectureError",
           "CheckpointMismatchError", "CheckpointFormatError", "ModelNotFoundError",
           "WorkerDiedError"]
