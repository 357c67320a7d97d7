"""build_runner: one in-process ModelRunner for TP=1; a driver over N ranks otherwise. Either
way the engine sees only the Runner protocol (engine/runner.py)."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .runner import Runner


def build_runner(config, hf_config, model_path: str, max_model_len: int) -> "Runner":
    if config.tensor_parallel_size == 1:
        from .model_runner import ModelRunner
        return ModelRunner(config, hf_config, model_path, max_model_len)
    from .parallel import TPDriver
    return TPDriver(config, hf_config, model_path, max_model_len)
