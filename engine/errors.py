"""Exceptions a user can act on. Each message says what was wrong and what to do.

Callers tell them apart by type, never by message text (so a message may be reworded freely):

    GlassboxError
    ├── InvalidArgumentError (ValueError)   a caller's argument is wrong; .param names it
    │   └── OutOfCapacityError              the request can never fit this engine
    │       └── PromptTooLongError
    ├── EngineUnavailableError (RuntimeError)   no engine to serve now; retry later
    │   ├── EngineShutdownError             shut down (or switched) under the request
    │   └── ModelSwitchingError             a model is loading; this request came meanwhile
    ├── EngineFailedError (RuntimeError)    the engine broke; create a new LLM
    │   └── WorkerDiedError
    ├── RequestFailedError (RuntimeError)   this request's data broke a step; others go on
    └── ModelLoadError                      the checkpoint cannot be served
        ├── UnsupportedArchitectureError (ValueError)
        ├── CheckpointFormatError (ValueError)
        ├── CheckpointMismatchError (RuntimeError)
        └── ModelNotFoundError (FileNotFoundError)

The builtin bases stay, so `except ValueError` / `except RuntimeError` written before this
hierarchy keeps catching what it caught.
"""
from __future__ import annotations


class GlassboxError(Exception):
    """Every error the engine raises on purpose."""


# ---- a request the caller must change ----------------------------------------------------------
class InvalidArgumentError(GlassboxError, ValueError):
    """An argument of the Python API is wrong. `param` names it as the caller wrote it (`prompt`,
    `top_p`, `watch.layers`, `max_model_len`); None when no one argument is to blame."""
    default_param: str | None = None

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param if param is not None else self.default_param

    def __reduce__(self):          # pickles with its param (a TP worker, a process pool)
        return type(self), (str(self), self.param)


class OutOfCapacityError(InvalidArgumentError):
    """The request can never fit this engine, however long it waits (its size, not the load):
    a bigger engine or a smaller request is the only fix."""
    default_param = "prompt"


class PromptTooLongError(OutOfCapacityError):
    """The prompt can never fit: longer than max_model_len, or than the whole KV cache."""


# ---- the engine cannot serve now ---------------------------------------------------------------
class EngineUnavailableError(GlassboxError, RuntimeError):
    """No engine can take this request right now; the same request may succeed later."""


class EngineShutdownError(EngineUnavailableError):
    """The engine was shut down (or switched) while this request was in flight."""


class ModelSwitchingError(EngineUnavailableError):
    """A request arrived while another model is being loaded in place of the current one."""


class EngineFailedError(GlassboxError, RuntimeError):
    """The engine itself failed (not one request) and cannot serve again; create a new LLM."""


class WorkerDiedError(EngineFailedError):
    """A tensor-parallel worker process exited; the engine cannot continue."""


class RequestFailedError(GlassboxError, RuntimeError):
    """This request's own data made an engine step fail; the engine goes on serving others."""


# ---- loading a model ---------------------------------------------------------------------------
class ModelLoadError(GlassboxError):
    """The model cannot be loaded as given: a fix to the checkpoint or the model id is needed."""


class UnsupportedArchitectureError(ModelLoadError, ValueError):
    """config.json names an architecture this engine does not implement."""


class CheckpointMismatchError(ModelLoadError, RuntimeError):
    """The checkpoint's tensors do not match the model's parameters (missing or unexpected)."""


class CheckpointFormatError(ModelLoadError, ValueError):
    """A checkpoint file cannot be used as it is (invalid config.json, corrupt safetensors, a
    shard path leaving the directory, a tokenizer that would run code from the checkpoint)."""


class ModelNotFoundError(ModelLoadError, FileNotFoundError):
    """Neither a local directory nor a hub id that can be fetched."""
