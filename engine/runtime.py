"""build_runner: one in-process ModelRunner for TP=1; a driver over N ranks otherwise."""
from __future__ import annotations


def build_runner(config, hf_config, model_path: str, max_model_len: int):
    if config.tensor_parallel_size == 1:
        from .model_runner import ModelRunner
        return ModelRunner(config, hf_config, model_path, max_model_len)
    from .parallel import TPDriver
    return TPDriver(config, hf_config, model_path, max_model_len)
