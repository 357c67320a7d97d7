"""The "Try this" list's contents: interventions with a visible effect on the loaded demo,
found by tools/find_interventions.py, not written down by hand.

The search takes tens of seconds on two CPU cores, so it runs once per checkpoint in a
background thread, on an engine of its own (its dozens of requests stay out of the KV map, the
Engine tab and the latency table), and its result is kept on disk, keyed by the checkpoint's
files and the search's own source: the next start reads it at once. A real (non-demo)
checkpoint has no trained tasks to search on: its list stays empty.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "find_interventions.py"


def _tool():
    """tools/find_interventions.py as a module (tools/ is scripts, not a package); registered
    before it runs, as its dataclass needs."""
    name = "glassbox_find_interventions"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, TOOL)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


def cache_dir() -> Path:
    return Path(os.environ.get("GLASSBOX_CACHE_DIR") or Path.home() / ".cache" / "glassbox")


def cache_key(model_path: str, system: str) -> str:
    """Changes when the checkpoint's files, the system prompt or the search itself change."""
    h = hashlib.sha256(TOOL.read_bytes())
    h.update(system.encode())
    folder = Path(model_path).resolve()
    for f in sorted(folder.glob("*.json")) + sorted(folder.glob("*.safetensors")):
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:32]


def cache_path(model_path: str, system: str, engine_kwargs: dict) -> Path:
    """Where a search's result is kept: one file per checkpoint, system prompt, search source
    and the engine's device and dtype (greedy replies may differ by dtype)."""
    settings = repr(sorted((k, str(v)) for k, v in engine_kwargs.items()))
    return cache_dir() / "effects" / f"{cache_key(model_path, system + settings)}.json"


class FoundEffects:
    """Per checkpoint path: None while its search runs, then its effects (dicts with the
    fields of find_interventions.Effect), or an error line."""

    def __init__(self, system: str):
        self.system = system
        self._found: dict[str, list[dict] | str | None] = {}
        self._lock = threading.Lock()

    def get(self, model_path: str) -> list[dict] | str | None:
        with self._lock:
            return self._found.get(str(model_path))

    def start(self, model_path: str, llm_kwargs: dict | None = None) -> None:
        """Read the cached result, or search in the background (once per checkpoint)."""
        key = str(model_path)
        with self._lock:
            if key in self._found:
                return
            self._found[key] = None
        # the search's engine: the page's device and dtype
        kw = {k: v for k, v in (llm_kwargs or {}).items() if k in ("device", "dtype")}
        path = cache_path(key, self.system, kw)
        try:
            self._set(key, json.loads(path.read_text()))
            return
        except (OSError, ValueError):
            pass
        threading.Thread(target=self._search, args=(key, path, kw),
                         name="glassbox-find-effects", daemon=True).start()

    def _set(self, key: str, value) -> None:
        with self._lock:
            self._found[key] = value

    def _search(self, key: str, path: Path, kw: dict) -> None:
        from engine import LLM
        try:
            # a small cache of its own: the search runs one batch of short prompts at a time
            with LLM(key, num_kv_blocks=64, **kw) as llm:
                found = [e.to_dict() for e in _tool().search(llm, self.system)]
        except Exception as e:      # noqa: BLE001 — a failed search must not touch the page
            self._set(key, f"the search for effects failed: {e}")
            return
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(found))
        except OSError:             # a read-only home: found again at the next start
            pass
        self._set(key, found)
