"""The model card's sampling defaults (generation_config.json), applied when a request leaves a
field out: vLLM's `--generation-config auto` behaviour. Only the sampling keys vLLM reads are
taken (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens -> max_tokens);
`do_sample` is not one of them (vLLM ignores it too), so a greedy card says temperature 0."""
from __future__ import annotations

import json
import logging
import math
import os
import weakref

log = logging.getLogger("glassbox.api")

_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
         "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
_CACHE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def read_defaults(model_path: str | None) -> dict:
    """{request field: value} from `<model_path>/generation_config.json`; {} when absent or
    unreadable (a bad file is logged, never fatal: requests still run with OpenAI's defaults)."""
    if not model_path:
        return {}
    file = os.path.join(model_path, "generation_config.json")
    if not os.path.exists(file):
        return {}
    try:
        with open(file, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, ValueError) as e:
        log.warning("ignoring %s: %s", file, e)
        return {}
    out = {}
    for key, field in _KEYS.items():
        v = raw.get(key) if isinstance(raw, dict) else None
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            out[field] = int(v) if field in ("top_k", "max_tokens") else float(v)
    return out


def model_defaults(llm) -> dict:
    """read_defaults for this engine's checkpoint, read once per engine."""
    try:
        return _CACHE[llm]
    except (KeyError, TypeError):
        pass
    d = read_defaults(getattr(llm, "model_path", None))
    if d:
        log.info("sampling defaults from generation_config.json: %s", d)
    try:
        _CACHE[llm] = d
    except TypeError:           # an object that cannot be weakly referenced (a test stub)
        pass
    return d
