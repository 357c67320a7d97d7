"""The API without the playground: a bare FastAPI app, and uvicorn in a background thread
(benchmarks and scripts; the playground mounts the same router on Gradio's own server)."""
from __future__ import annotations

import threading
import time

from engine.parallel import free_port
from engine.serving import ServingHub

from .connections import ConnectionLimits, configure
from .cors import APICors, CORSSettings, every_path
from .routes import EngineHolder, build_router


def create_app(engines, api_key: str | None = None, *, limits=None,
               allowed_hosts: tuple[str, ...] = (), public_traces: bool = False,
               served_model_names: tuple[str, ...] = (), cors: CORSSettings | None = None):
    """FastAPI app serving only /v1/*. `engines`: an object with `.llm`, or an LLM itself.
    The same guard as the playground's (api.guard) stands in front of it, and CORS with vLLM's
    settings (api.cors) in front of that. `served_model_names`: vLLM's --served-model-name."""
    from fastapi import FastAPI
    from starlette.middleware import Middleware

    from .errors import exception_handlers
    from .limits import Limits, Pools
    from .model_names import check_names
    if not isinstance(engines, ServingHub):
        engines = EngineHolder(engines)
    engines.served_model_names = check_names(served_model_names)   # api.model_names
    limits = limits or Limits()
    pools = Pools(limits)
    app = FastAPI(title="Glassbox OpenAI-compatible API", docs_url=None, redoc_url=None,
                  middleware=[Middleware(APICors, settings=cors, keyed=bool(api_key)),
                              guard_middleware(api_key, allowed_hosts, limits, pools, cors)],
                  exception_handlers=exception_handlers())
    app.include_router(build_router(engines, api_key, limits=limits, pools=pools,
                                    public_traces=public_traces))
    return app


def guard_middleware(api_key: str | None, allowed_hosts: tuple[str, ...], limits, pools,
                     cors: CORSSettings | None = None, is_api_path=every_path):
    """api.guard.Guard as a Starlette Middleware entry (for FastAPI(middleware=[...])).
    `is_api_path`: which paths are the API's (the rest are Gradio's)."""
    from starlette.middleware import Middleware

    from .guard import Guard
    return Middleware(Guard, api_key=api_key, allowed_hosts=tuple(allowed_hosts),
                      limits=limits, pools=pools, cors=cors, is_api_path=is_api_path)


class BackgroundServer:
    """uvicorn serving `app` from a daemon thread; `stop()` shuts it down. `connections`: the
    header, body and keep-alive deadlines and the connection cap (api.connections)."""

    def __init__(self, app, host: str = "127.0.0.1", port: int | None = None,
                 log_level: str = "warning", connections: ConnectionLimits | None = None):
        import uvicorn
        self.host, self.port = host, port or free_port(host)
        config = uvicorn.Config(app, host=self.host, port=self.port, log_level=log_level,
                                access_log=False)
        configure(config, connections or ConnectionLimits(timeout_keep_alive=30))
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True, name="api-server")
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.time() > deadline:
                raise RuntimeError(f"the API server did not start on {self.host}:{self.port}")
            time.sleep(0.02)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
