"""OpenAI-compatible HTTP API over the Glassbox engine, a drop-in for vLLM's server: /v1/models,
/v1/chat/completions, /v1/completions (streaming or not), /v1/glassbox/traces for watched
requests, and the operations routes /health, /version, /metrics, /tokenize, /detokenize.

`build_router(engines, api_key)` gives a FastAPI APIRouter; the playground mounts its routes on
Gradio's own server (app.py), `api.server.create_app` serves them alone. Nothing here imports
gradio or views/: the routes only need an object whose `.llm` is the current engine.
"""
from .auth import API_KEY_ENV, exposure_warning, resolve_api_key
from .routes import EngineHolder, build_router

__all__ = ["build_router", "EngineHolder", "resolve_api_key", "exposure_warning", "API_KEY_ENV"]
