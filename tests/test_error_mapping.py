"""The engine's errors reach HTTP by their type: the status, the OpenAI `code` and `param` come
from the exception's class and its `param` attribute, never from its message, so rewording a
message cannot change what a client sees (besides the message)."""
from __future__ import annotations

import pickle
import uuid

import pytest

from api.errors import ENGINE_ERRORS, from_engine
from api.protocol import ChatCompletionRequest, CompletionRequest
from api.sampling import request_param, sampling_params
from api.serving import engine_error
from engine import (EngineFailedError, EngineShutdownError, InvalidArgumentError,
                    ModelSwitchingError, OutOfCapacityError, ProbeSpec, PromptTooLongError,
                    RequestFailedError, WorkerDiedError)
from engine import errors as engine_errors


def _noise() -> str:
    """A message no mapping could recognise."""
    return f"zz {uuid.uuid4().hex}"


# ---- the hierarchy keeps the builtin bases -------------------------------------------------------
@pytest.mark.parametrize("cls,base", [
    (InvalidArgumentError, ValueError), (PromptTooLongError, ValueError),
    (OutOfCapacityError, ValueError), (EngineShutdownError, RuntimeError),
    (ModelSwitchingError, RuntimeError), (WorkerDiedError, RuntimeError),
    (RequestFailedError, RuntimeError), (EngineFailedError, RuntimeError),
    (engine_errors.CheckpointFormatError, ValueError),
    (engine_errors.UnsupportedArchitectureError, ValueError),
    (engine_errors.CheckpointMismatchError, RuntimeError),
    (engine_errors.ModelNotFoundError, FileNotFoundError),
])
def test_every_engine_error_keeps_its_builtin_base(cls, base):
    assert issubclass(cls, base) and issubclass(cls, engine_errors.GlassboxError)


def test_an_invalid_argument_keeps_its_param_through_pickle():
    e = pickle.loads(pickle.dumps(InvalidArgumentError("bad", "top_p")))
    assert (type(e), str(e), e.param) == (InvalidArgumentError, "bad", "top_p")
    assert PromptTooLongError("long").param == "prompt"      # its argument by default


# ---- engine error -> status, code, param --------------------------------------------------------
@pytest.mark.parametrize("make,status,code", [
    (lambda m: PromptTooLongError(m), 400, "context_length_exceeded"),
    (lambda m: InvalidArgumentError(m, "temperature"), 400, None),
    (lambda m: ValueError(m), 500, "engine_error"),     # untyped: the server's fault (#47)
    (lambda m: ModelSwitchingError(m), 503, "model_switching"),
    (lambda m: EngineShutdownError(m), 503, "engine_unavailable"),
    (lambda m: WorkerDiedError(m), 500, "engine_error"),
    (lambda m: EngineFailedError(m), 500, "engine_error"),
    (lambda m: RequestFailedError(m), 500, "engine_error"),
    (lambda m: RuntimeError(m), 500, "engine_error"),
])
@pytest.mark.parametrize("message", ["the engine has been shut down", "shut down", ""])
def test_the_status_follows_the_type_whatever_the_message(make, status, code, message):
    """"shut down" in a RuntimeError's text once made a 503; now only the type does."""
    for text in (message, _noise()):
        err = from_engine(make(text))
        assert (err.status, err.code) == (status, code), text
        assert ("Retry-After" in err.headers) == (status == 503)


def test_the_table_lists_specific_types_before_their_bases():
    """A row never hides a later row: the first match by isinstance is the most specific."""
    types = [row[0] for row in ENGINE_ERRORS]
    for i, a in enumerate(types):
        for b in types[i + 1:]:
            assert not issubclass(b, a), f"{b.__name__} is shadowed by {a.__name__}"
    assert types[-1] is BaseException                  # everything gets an answer


@pytest.mark.parametrize("param,chat,expected", [
    ("prompt", True, "messages"), ("prompt", False, "prompt"),
    ("stop_token_ids", True, "stop_token_ids"), ("logprobs", True, "top_logprobs"),
    ("logprobs", False, "logprobs"), ("watch.layers", False, "glassbox.watch"),
    ("request_id", True, None),
])
def test_an_engine_argument_becomes_the_request_field_it_came_from(param, chat, expected):
    err = engine_error(InvalidArgumentError(_noise(), param), "messages" if chat else "prompt",
                       chat)
    assert (err.status, err.param) == (400, expected)


def test_an_invalid_argument_without_a_param_blames_the_prompt():
    """A refusal that names no field (the processor's are typed) is about the messages."""
    err = engine_error(InvalidArgumentError(_noise()), "messages", True)
    assert (err.status, err.param) == (400, "messages")


def test_an_internal_value_error_is_a_500_naming_the_request_id():
    """An untyped ValueError from inside the engine is a bug of the server, not a client error:
    a 500 whose message names the request (the log has it), never a 400 blaming the client."""
    err = engine_error(ValueError(_noise()), "messages", True, "chatcmpl-abc-1")
    assert (err.status, err.code) == (500, "engine_error")
    assert "chatcmpl-abc-1" in err.message


# ---- request fields -> SamplingParams errors naming the request's field -------------------------
def _chat(**kw):
    """Built without pydantic's checks, so the engine's own check is the one that refuses."""
    return ChatCompletionRequest.model_construct(
        model="m", messages=[{"role": "user", "content": "hi"}], **kw)


@pytest.mark.parametrize("req,param", [
    (_chat(temperature=-1), "temperature"),
    (_chat(top_p=1.5), "top_p"),
    (_chat(max_completion_tokens=0), "max_completion_tokens"),
    (_chat(max_tokens=0), "max_tokens"),
    (_chat(stop=[""]), "stop"),
    (_chat(stop_token_ids=[-1]), "stop_token_ids"),     # once "stop", by the message's prefix
    (_chat(min_p=2.0), "min_p"),
    (CompletionRequest.model_construct(model="m", prompt="hi", max_tokens=0), "max_tokens"),
])
def test_a_bad_sampling_field_is_a_400_naming_the_request_field(req, param):
    from api.errors import APIError
    with pytest.raises(APIError) as err:
        sampling_params(req, max_model_len=64, prompt_len=1)
    assert (err.value.status, err.value.param) == (400, param)


@pytest.mark.parametrize("field", ["max_tokens", "top_p", "temperature", "stop_token_ids"])
def test_a_message_that_names_another_field_changes_nothing(field):
    """Messages that start with another field's name (what a startswith parse went by) leave
    the status and the param as the type and its `param` say."""
    answers = {(e.status, e.code, e.param) for e in (
        engine_error(InvalidArgumentError(text, field), "messages", True)
        for text in (_noise(), "temperature must be >= 0", "stop strings must be non-empty",
                     "the engine has been shut down"))}
    assert answers == {(400, None, request_param(field, True))}


def test_probe_spec_errors_name_the_watch_field():
    with pytest.raises(InvalidArgumentError) as err:
        ProbeSpec(lens_top_k=0)
    assert err.value.param == "watch.lens_top_k"
