"""Build the OpenAI client's response models once, on one thread, before tests use the client
from several threads at once.

openai declares its models with pydantic's `defer_build=True`: a model's core schema is a
placeholder until first use, and the first `construct` that touches it rebuilds it. That
rebuild is not thread-safe: eight threads constructing a `ChatCompletion` for the first time
at once raise `PydanticUserError: ... BaseModel cannot be instantiated directly` (or an
AttributeError) in some of them — seen in CI in LangChain's `ChatOpenAI.batch`, which runs each
request on its own thread, and reproduced with 8 threads and `sys.setswitchinterval(1e-6)`.
It is the client's race, not the server's: a request that reached our server and came back is
lost in the client's parser. Building the outer model alone is not enough (its nested models,
e.g. a choice's message, stay deferred), so this walks every model its fields name."""
from __future__ import annotations

import typing


def _models_in(annotation):
    import pydantic
    if isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel):
        yield annotation
    for arg in typing.get_args(annotation):
        yield from _models_in(arg)


def build_response_models() -> list[type]:
    """Force the core schema of each response model the tests read (and of every model nested
    in one); returns the models built. A no-op where openai is not installed."""
    try:
        from openai.types import Completion, CreateEmbeddingResponse, Model
        from openai.types.chat import ChatCompletion, ChatCompletionChunk
        from openai.types.responses import Response
    except ImportError:
        return []
    seen: list[type] = []
    stack = [ChatCompletion, ChatCompletionChunk, Completion, CreateEmbeddingResponse, Model,
             Response]
    while stack:
        cls = stack.pop()
        if cls in seen:
            continue
        seen.append(cls)
        cls.__pydantic_core_schema__["type"]        # a deferred model rebuilds on this read
        for field in cls.model_fields.values():
            stack.extend(_models_in(field.annotation))
    return seen
