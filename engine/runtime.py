"""build_runner: one in-process ModelRunner for TP=1, a TPDriver over N ranks otherwise (either
way a Runner, engine/runner.py). The kernel choices are settled here, once per engine, and
every rank runs with the same ones (`runner.kernel_config`)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from .kernel_config import KernelConfig

if TYPE_CHECKING:
    from .runner import Runner


def build_runner(config, hf_config, model_path: str, max_model_len: int,
                 kernel_config: KernelConfig | None = None) -> "Runner":
    kernels = kernel_config if kernel_config is not None else KernelConfig.build(config)
    if config.tensor_parallel_size == 1:
        from .model_runner import ModelRunner
        return ModelRunner(config, hf_config, model_path, max_model_len, kernel_config=kernels)
    from .parallel import TPDriver
    return TPDriver(config, hf_config, model_path, max_model_len, kernel_config=kernels)
