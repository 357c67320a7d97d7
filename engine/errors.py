"""Exceptions a user can act on. Each message says what was wrong and what to do."""


class PromptTooLongError(ValueError):
    """The prompt can never fit: longer than max_model_len, or than the whole KV cache."""


class UnsupportedArchitectureError(ValueError):
    """config.json names an architecture this engine does not implement."""


class CheckpointMismatchError(RuntimeError):
    """The checkpoint's tensors do not match the model's parameters (missing or unexpected)."""


class CheckpointFormatError(ValueError):
    """A checkpoint file cannot be used as it is: an invalid config.json, a truncated or corrupt
    safetensors file, a shard path that leaves the checkpoint directory, a tokenizer that would
    run code shipped in the checkpoint."""


class ModelNotFoundError(FileNotFoundError):
    """Neither a local directory nor a hub id that can be fetched."""


class WorkerDiedError(RuntimeError):
    """A tensor-parallel worker process exited; the engine cannot continue."""


class RequestFailedError(RuntimeError):
    """This request's own data made an engine step fail; the engine goes on serving others."""


class EngineShutdownError(RuntimeError):
    """The engine was shut down (or switched) while this request was in flight."""
