"""The API alone (no playground) over the demo checkpoint on the CPU, for the API tests."""
from __future__ import annotations

import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "assets", "demo-qwen3")
KEY = "dropin-key"


class ServedAPI:
    def __init__(self, model: str = DEMO, api_key: str | None = KEY, engines=None, **llm_kw):
        from api.server import BackgroundServer, create_app
        from engine import LLM
        self.llm = LLM(model, device="cpu", dtype="float32",
                       **{"num_kv_blocks": 96, "block_size": 16, **llm_kw})
        self.engines = engines
        if engines is not None:
            engines.llm = self.llm
        self.server = BackgroundServer(create_app(engines or self.llm, api_key))
        self.url = self.server.url
        self.model = self.llm.model_name
        self.key = api_key

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.key}"} if self.key else {}

    def post(self, path: str, body: dict, headers: dict | None = None, timeout: float = 60):
        import httpx
        return httpx.post(self.url + path, json=body, headers={**self.headers, **(headers or {})},
                          timeout=timeout)

    def client(self):
        from openai import OpenAI
        return OpenAI(base_url=self.url + "/v1", api_key=self.key or "none", max_retries=0,
                      timeout=60)

    def close(self) -> None:
        self.server.stop()
        self.llm.shutdown()
