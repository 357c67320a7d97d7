"""Test-only behaviour for tensor-parallel workers, installed by a test with
`monkeypatch.setattr(TPDriver, "worker_hooks", Hook(rank))`: the driver hands the object to
each spawned worker (it is pickled, so it lives in an importable module: spawned workers get
the test process's sys.path), which calls started(rank) before it builds anything and
received(rank, cmd) for every command. Production engines have no hooks."""
from __future__ import annotations

import signal
import time


class WorkerHooks:
    """Does nothing: the base for the hooks below."""

    def __init__(self, rank: int):
        self.rank = rank

    def started(self, rank: int) -> None:
        pass

    def received(self, rank: int, cmd: str) -> None:
        pass


class FailAtStart(WorkerHooks):
    """Worker `rank` dies at start-up, before joining the process group."""

    def started(self, rank: int) -> None:
        if rank == self.rank:
            raise RuntimeError("worker start-up failure requested by a test hook")


class DeafToShutdown(WorkerHooks):
    """Worker `rank` ignores the shutdown command and SIGTERM (only SIGKILL ends it)."""

    def received(self, rank: int, cmd: str) -> None:
        if rank == self.rank and cmd == "shutdown":
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            time.sleep(3600)
