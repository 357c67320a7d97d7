"""`"interventions": [...]` in a /v1/chat/completions or /v1/completions body -> the engine's
Intervention list. Each entry is parsed here (a malformed one is a 400 whose `param` names it,
`interventions[1].heads`); the engine's processor checks the list against the served model,
once, and its refusal names the field the same way.

  {"kind": "ablate_heads", "layer": 1, "heads": [0, 3]}
  {"kind": "mask_experts", "layer": 0, "experts": [5]}
  {"kind": "steer", "layer": 2, "vector": [... hidden_size numbers ...], "scale": 4.0,
   "positions": "all" | "prompt" | "generated"}
  {"kind": "clamp_attention", "layer": 1, "heads": [2], "positions": [0, 5]}
"""
from __future__ import annotations

import re

from engine import Intervention
from engine.interventions.spec import MAX_INTERVENTIONS

from .errors import bad_request


def interventions_of(body) -> list[Intervention] | None:
    raw = getattr(body, "interventions", None)
    if not raw:
        return None
    if not isinstance(raw, list):
        raise bad_request("interventions must be a list of objects", "interventions")
    if len(raw) > MAX_INTERVENTIONS:        # before parsing any: each is work
        raise bad_request(f"{len(raw)} interventions given; at most {MAX_INTERVENTIONS} per "
                          "request", "interventions")
    ivs = []
    for i, d in enumerate(raw):
        try:
            ivs.append(Intervention.from_dict(d))
        except ValueError as e:
            raise bad_request(f"interventions[{i}]: {e}", _param(i, str(e))) from None
    return ivs


def _param(i: int, message: str) -> str:
    """interventions[i].field for the field the message is about."""
    m = re.search(r"unknown field\(s\) \['([^']+)'", message)
    if m:
        return f"interventions[{i}].{m.group(1)}"
    for field in ("heads", "experts", "vector", "scale", "positions", "layer", "kind"):
        if re.search(rf"\b{field}\b", message):
            return f"interventions[{i}].{field}"
    return f"interventions[{i}]"
