"""The Runner protocol (engine/runner.py) is the whole interface between the engine and the
model side: the local ModelRunner and the TP driver both satisfy it, the driver offers exactly
it (no attribute forwarding), and a TP worker runs only the protocol's commands."""
from __future__ import annotations

import inspect

import pytest

from engine import LLM
from engine.model_runner import ModelRunner
from engine.parallel import (SHUTDOWN, WORKER_COMMANDS, TPDriver, UnknownWorkerCommand,
                             worker_command)
from engine.runner import Runner

# what the driver has besides the protocol: the hooks tests install (tests/tp_hooks.py)
DRIVER_EXTRAS = {"worker_hooks"}


def protocol_members() -> set[str]:
    """Methods, properties and declared attributes of the Runner protocol."""
    names = {n for n in vars(Runner) if not n.startswith("_")}
    return names | set(Runner.__annotations__)


def public_members(cls) -> set[str]:
    return {n for n in vars(cls) if not n.startswith("_")}


def test_the_protocol_names_what_the_engine_calls():
    assert protocol_members() == {
        "model", "kv_cache", "device", "kernel_config", "num_params", "moe_layers", "bytes_per_block",
        "tp_layout", "read_kv_block", "profile_num_blocks", "allocate_kv_cache",
        "capture_graphs", "execute_step", "check_workers", "shutdown", "fills_masks_late"}


def test_a_local_model_runner_satisfies_the_protocol(qwen3_dir):
    with LLM(qwen3_dir, device="cpu", block_size=4, num_kv_blocks=8) as llm:
        assert isinstance(llm.runner, ModelRunner)
        assert isinstance(llm.runner, Runner)
        for name in protocol_members():
            assert hasattr(llm.runner, name), name


def test_the_tp_driver_offers_exactly_the_protocol():
    """Every protocol member is defined on the driver itself, and nothing else is public: no
    `__getattr__` forwards other attributes to rank 0."""
    assert "__getattr__" not in vars(TPDriver)
    assert public_members(TPDriver) == protocol_members() | DRIVER_EXTRAS
    for name in protocol_members() & public_members(ModelRunner):
        a, b = getattr(TPDriver, name), getattr(ModelRunner, name)
        if callable(a) and callable(b):        # the same parameters as the local runner
            assert list(inspect.signature(a).parameters) == \
                list(inspect.signature(b).parameters), name


def test_a_worker_runs_only_the_protocols_commands():
    assert set(WORKER_COMMANDS) <= protocol_members()
    for cmd in WORKER_COMMANDS:
        assert worker_command(cmd) is getattr(ModelRunner, cmd)


@pytest.mark.parametrize("cmd", ["read_kv_block", "__init__", "model", "kv_cache", "_to_host",
                                 "exec", "", None, SHUTDOWN])
def test_an_unknown_worker_command_is_refused(cmd):
    """Facts, private methods and arbitrary names never run on a worker (shutdown is the loop's
    own, not a runner method)."""
    with pytest.raises(UnknownWorkerCommand, match="runs only"):
        worker_command(cmd)


def test_the_driver_refuses_an_unknown_command_before_sending_it():
    driver = TPDriver.__new__(TPDriver)     # no workers, no channel: nothing may be touched
    with pytest.raises(UnknownWorkerCommand):
        driver._run("load_some_code", "x")
