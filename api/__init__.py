"""OpenAI-compatible HTTP API over the Glassbox engine, a drop-in for vLLM's server: /v1/models,
/v1/chat/completions, /v1/completions, /v1/responses (streaming or not; api.responses_api),
/v1/glassbox/traces for watched requests, and the operations routes /health, /version,
/metrics, /tokenize, /detokenize.

`build_router(engines, api_key)` gives a FastAPI APIRouter; the playground mounts its routes on
Gradio's own server (app.py), `api.server.create_app` serves them alone. Nothing here imports
gradio or views/: the routes only need an object whose `.llm` is the current engine.

The names below load on first use, so `api.cli` (the command line) answers `--help` or refuses
a flag without importing the engine.
"""
from importlib import import_module

_HOME = {"build_router": ".routes", "EngineHolder": ".routes", "resolve_api_key": ".auth",
         "exposure_warning": ".auth", "API_KEY_ENV": ".auth"}
__all__ = list(_HOME)


def __getattr__(name: str):
    if name in _HOME:
        return getattr(import_module(_HOME[name], __name__), name)
    raise AttributeError(f"module 'api' has no attribute {name!r}")
