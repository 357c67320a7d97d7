"""Glassbox engine: a paged-KV Qwen inference engine whose internals can be watched."""
from .errors import (CheckpointFormatError, CheckpointMismatchError, EngineFailedError,
                     EngineShutdownError, EngineUnavailableError, GlassboxError,
                     InvalidArgumentError, ModelLoadError, ModelNotFoundError,
                     ModelSwitchingError, OutOfCapacityError, PromptTooLongError,
                     RequestFailedError, UnsupportedArchitectureError, WorkerDiedError)
from .interventions.spec import Intervention
from .llm import LLM
from .probes.spec import ProbeSpec
from .sampling_params import SamplingParams
from .sequence import RequestOutput, TokenEvent
from .spec_decode import DraftVerdict, SpeculativeConfig
from .records import EngineSnapshot
from .probes.trace import RequestTrace

__all__ = ["LLM", "Intervention", "SamplingParams", "ProbeSpec", "RequestOutput", "TokenEvent",
           "EngineSnapshot", "SpeculativeConfig", "DraftVerdict", "RequestTrace",
           "PromptTooLongError", "UnsupportedArchitectureError", "CheckpointMismatchError",
           "CheckpointFormatError", "ModelNotFoundError", "WorkerDiedError", "GlassboxError",
           "InvalidArgumentError", "OutOfCapacityError", "EngineUnavailableError",
           "EngineShutdownError", "ModelSwitchingError", "EngineFailedError",
           "RequestFailedError", "ModelLoadError"]
