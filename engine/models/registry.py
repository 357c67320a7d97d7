"""Architecture name (config.architectures[0]) -> model class."""
from __future__ import annotations

from ..errors import UnsupportedArchitectureError


def _dense():
    from .qwen import QwenForCausalLM
    return QwenForCausalLM


def _moe():
    from .qwen_moe import QwenMoeForCausalLM
    return QwenMoeForCausalLM


_REGISTRY = {
    "Qwen2ForCausalLM": _dense, "Qwen3ForCausalLM": _dense,
    "Qwen2MoeForCausalLM": _moe, "Qwen3MoeForCausalLM": _moe,
}


def supported_architectures() -> list[str]:
    return sorted(_REGISTRY)


def model_class(config):
    archs = getattr(config, "architectures", None) or []
    for arch in archs:
        if arch in _REGISTRY:
            return _REGISTRY[arch]()
    raise UnsupportedArchitectureError(
        f"architecture {archs or '(none in config.json)'} is not supported by Glassbox; "
        f"supported: {', '.join(supported_architectures())}. Use a Qwen2/2.5/3 or Qwen MoE "
        "checkpoint, or add the model under engine/models/ and register it here.")
