"""Operations routes beside /v1, with vLLM's paths and shapes: /health and /ping (200 only when
the engine can serve; 503 while the playground switches models or after the engine failed), /version,
/metrics (Prometheus), /tokenize and /detokenize. /health, /ping, /version and /metrics are open (a
load balancer or Prometheus probes them without a key, as vLLM's); /tokenize and /detokenize
run the model's tokenizer and take the API key like /v1."""
from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends
from pydantic import Field
from starlette.concurrency import run_in_threadpool
from starlette.responses import JSONResponse, Response

from engine.errors import InvalidArgumentError, PromptTooLongError

from .errors import APIError, OpenAIRoute, bad_request
from .metrics import CONTENT_TYPE, EngineMetrics
from .protocol import ChatMessage, Lenient

VERSION = "0.1.0"


class TokenizeRequest(Lenient):
    """vLLM's: `prompt` (completions) or `messages` (chat, through the chat template with the
    same options as /v1/chat/completions, so `count` is the prompt_tokens that request gets)."""
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    return_token_strs: bool = False
    # chat only, as /v1/chat/completions reads them (api.chat_template)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    chat_template: str | None = None        # refused, as on /v1/chat/completions


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
        if engines.switching:
            raise APIError(503, "the model is being switched; retry in a few seconds",
                           code="model_switching", headers={"Retry-After": "5"})
        stats = await run_in_threadpool(engines.llm.stats)
        if not stats.get("alive", False):
            raise APIError(503, "the engine is not running (shut down or failed)",
                           code="engine_unavailable")
        return Response(status_code=200)

    # vLLM's /ping (SageMaker's health check), GET and POST: the same answer as /health
    open_routes.add_api_route("/ping", health, methods=["GET", "POST"])

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

        if body.chat_template is not None:
            from .sampling import CHAT_TEMPLATE_REFUSED
            raise bad_request(CHAT_TEMPLATE_REFUSED, "chat_template")
        if body.messages is not None and body.continue_final_message:
            if body.add_generation_prompt:
                raise bad_request("continue_final_message continues the last assistant "
                                  "message: set add_generation_prompt to false with it",
                                  "continue_final_message")
            if body.messages[-1].role != "assistant":
                raise bad_request("continue_final_message needs the last message to be the "
                                  "assistant's (the text to continue)", "continue_final_message")

        def encode() -> list[int]:
            """Through the engine's processor, so /tokenize is bounded as a prompt is (its
            characters before tokenizing) and counts what a request would run."""
            proc = llm.processor
            if body.prompt is not None:
                if not body.prompt:
                    return []
                ids = list(proc.tokenize(body.prompt).token_ids)
                tok = llm.tokenizer
                if body.add_special_tokens and tok.encode("", add_special_tokens=True):
                    # this tokenizer adds tokens (Qwen's add none): as encode does, once the
                    # prompt is known to be of a size that fits
                    ids = tok.encode(body.prompt, add_special_tokens=True)
                return ids
            from .chat_template import chat_options
            from .sampling import chat_messages
            return list(proc.tokenize(chat_messages(body), chat_options(body)).token_ids)
        try:
            ids = await run_in_threadpool(encode)
        except InvalidArgumentError as e:
            param = e.param if e.param and e.param.startswith("messages") else (
                "messages" if body.messages else "prompt")
            code = "context_length_exceeded" if isinstance(e, PromptTooLongError) else None
            raise bad_request(str(e), param, code) from None
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
