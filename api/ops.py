"""Operations routes beside /v1, with vLLM's paths and shapes: /health (200 only when the engine
can serve; 503 while the playground switches models or after the engine failed), /version,
/metrics (Prometheus), /tokenize and /detokenize. /health, /version and /metrics are open (a
load balancer or Prometheus probes them without a key, as vLLM's); /tokenize and /detokenize
run the model's tokenizer and take the API key like /v1."""
from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends
from pydantic import Field
from starlette.concurrency import run_in_threadpool
from starlette.responses import JSONResponse, Response

from .errors import APIError, OpenAIRoute, bad_request
from .metrics import CONTENT_TYPE, EngineMetrics
from .protocol import ChatMessage, Lenient

VERSION = "0.1.0"


class TokenizeRequest(Lenient):
    """vLLM's: `prompt` (completions) or `messages` (chat, through the chat template)."""
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(Lenient):
    model: str | None = None
    tokens: list[int] = Field(min_length=0)


def build_ops_routers(engines, current_engine, auth, metrics: EngineMetrics
                      ) -> tuple[APIRouter, APIRouter]:
    """(open routes, routes behind `auth`). `current_engine(model)`: the routes' engine lookup
    (503 while switching, 404 for another model's name)."""
    open_routes = APIRouter(route_class=OpenAIRoute)
    keyed = APIRouter(route_class=OpenAIRoute, dependencies=[Depends(auth)])

    @open_routes.get("/health")
    async def health():
        if getattr(engines, "switching", False):
            raise APIError(503, "the model is being switched; retry in a few seconds",
                           code="model_switching", headers={"Retry-After": "5"})
        llm = engines.llm
        stats = await run_in_threadpool(llm.stats) if hasattr(llm, "stats") else {"alive": True}
        if not stats.get("alive", False):
            raise APIError(503, "the engine is not running (shut down or failed)",
                           code="engine_unavailable")
        return Response(status_code=200)

    @open_routes.get("/version")
    async def version():
        return JSONResponse({"version": VERSION})

    @open_routes.get("/metrics")
    async def prometheus_metrics():
        return Response(await run_in_threadpool(metrics.render), media_type=CONTENT_TYPE)

    @keyed.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        llm = current_engine(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("give exactly one of 'prompt' (text) or 'messages' (a chat)",
                              "prompt")
        if llm.tokenizer is None:
            raise bad_request("this checkpoint has no tokenizer", "prompt")

        def encode() -> list[int]:
            if body.prompt is not None:
                return llm.tokenizer.encode(body.prompt,
                                            add_special_tokens=body.add_special_tokens)
            from .sampling import chat_messages
            return llm.encode(chat_messages(body))
        try:
            ids = await run_in_threadpool(encode)
        except ValueError as e:
            raise bad_request(str(e), "messages" if body.messages else "prompt") from None
        out: dict[str, Any] = {"count": len(ids), "max_model_len": llm.max_model_len,
                               "tokens": ids, "token_strs": None}
        if body.return_token_strs:
            out["token_strs"] = llm.tokenizer.convert_ids_to_tokens(ids)
        return JSONResponse(out)

    @keyed.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        llm = current_engine(body.model)
        if llm.tokenizer is None:
            raise bad_request("this checkpoint has no tokenizer", "tokens")
        vocab = llm.hf_config.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise bad_request(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})",
                              "tokens")
        text = await run_in_threadpool(llm.tokenizer.decode, body.tokens)
        return JSONResponse({"prompt": text})

    return open_routes, keyed
