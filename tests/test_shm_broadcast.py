"""The shared-memory step broadcast: messages arrive whole and in order, and the ring refuses
CPUs whose store ordering its correctness argument does not cover (engine/shm_broadcast.py)."""
from __future__ import annotations

import platform
import random

import pytest

from engine import LLM, InvalidArgumentError
from engine.shm_broadcast import PROVEN_MACHINES, ShmBroadcast, check_platform


@pytest.mark.skipif(platform.machine() not in PROVEN_MACHINES, reason="the ring refuses this CPU")
def test_messages_arrive_whole_and_in_order_through_the_ring():
    rng = random.Random()
    writer = ShmBroadcast(2, slot_bytes=1 << 16, num_slots=3)
    readers = [ShmBroadcast.attach(writer.handle()) for _ in range(2)]
    try:
        sent = [bytes(rng.getrandbits(8) for _ in range(rng.randrange(1, 5000)))
                for _ in range(10)]           # more messages than slots: slots are reused
        got: list[list[bytes]] = [[], []]
        for msg in sent:
            writer.send(("step", msg))
            for r, reader in enumerate(readers):
                got[r].append(reader.recv(r + 1)[1])
        assert got == [sent, sent]
    finally:
        for reader in readers:
            reader.close()
        writer.close()


@pytest.mark.parametrize("machine", ["aarch64", "arm64", "ppc64le", "riscv64", ""])
def test_a_cpu_without_proven_store_ordering_is_refused(machine):
    with pytest.raises(InvalidArgumentError) as err:
        check_platform(machine)
    msg = str(err.value)
    assert "x86-64" in msg and "tensor_parallel_size=1" in msg
    assert err.value.param == "tensor_parallel_size"


def test_x86_64_is_accepted():
    check_platform("x86_64")


def test_tensor_parallelism_is_refused_before_any_worker_starts(qwen3_dir, monkeypatch):
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    with pytest.raises(InvalidArgumentError, match="x86-64"):
        LLM(qwen3_dir, device="cpu", block_size=4, num_kv_blocks=8, tensor_parallel_size=2)
