"""Tensor parallelism across N processes: rank 0 lives in the calling process, ranks 1..N-1
are spawned workers. Each engine gets its own TCPStore on a free port and its own process
group (gloo on CPU, NCCL on GPU), so two engines never collide.

Rank 0 sends every command to the workers through a shared-memory ring (shm_broadcast.py: no
pickled queue or feeder thread on the hot path) and runs it itself at the same time; the
forward's collectives keep them in step. Workers get rank 0's KernelConfig, so every rank runs
the same kernels whatever its environment, and run only WORKER_COMMANDS.

Failures: a worker reports an exception on a result queue, and rank 0 checks the workers
whenever it waits, so a worker that dies raises within a second instead of hanging a
collective. Workers exit when their parent is gone; shutdown() kills one that ignores SIGTERM.
"""
from __future__ import annotations

import datetime
import os
import queue
import socket
import threading
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .errors import WorkerDiedError
from .kernel_config import KernelConfig
from .model_runner import ModelRunner
from .parallel_state import TPGroup
from .shm_broadcast import ShmBroadcast

TIMEOUT_S = 60    # the process group's collectives and store; GLASSBOX_TP_TIMEOUT_S overrides


def group_timeout() -> datetime.timedelta:
    """Read when a group is made (not at import), so a value set after `import engine` counts."""
    return datetime.timedelta(seconds=int(os.environ.get("GLASSBOX_TP_TIMEOUT_S") or TIMEOUT_S))


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now (the TP rendezvous; servers and tests use it too)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def make_group(rank: int, size: int, port: int, device: str) -> tuple[TPGroup, object]:
    timeout = group_timeout()
    store = dist.TCPStore("127.0.0.1", port, size, is_master=rank == 0, timeout=timeout)
    if device.startswith("cuda"):
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        pg = dist.ProcessGroupNCCL(store, rank, size, opts)
        kind = "cuda"
    else:
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        pg = dist.ProcessGroupGloo(store, rank, size, opts)
        kind = "cpu"
    return TPGroup(rank, size, pg, device_type=kind), store


def _exit_with_parent(ppid: int) -> None:
    """Worker watchdog: a worker whose parent died (killed, SIGTERM, crashed) exits too."""
    while True:
        time.sleep(0.5)
        if os.getppid() != ppid:
            os._exit(3)


# What a worker runs when rank 0 sends the command's name: the part of the Runner protocol
# (engine/runner.py) whose work every rank does. A fixed table, so a message can only ever run
# one of these; facts (kv_cache, tp_layout, ...) are read on rank 0 and never sent.
WORKER_COMMANDS = {
    "profile_num_blocks": ModelRunner.profile_num_blocks,
    "allocate_kv_cache": ModelRunner.allocate_kv_cache,
    "capture_graphs": ModelRunner.capture_graphs,
    "execute_step": ModelRunner.execute_step,
}
REPLYING_COMMANDS = frozenset({"profile_num_blocks"})   # rank 0 waits for every rank's answer
SHUTDOWN = "shutdown"


class UnknownWorkerCommand(ValueError):
    """Rank 0 sent a command outside WORKER_COMMANDS: a bug in the driver, never run."""


def worker_command(cmd: str):
    """The function a worker runs for `cmd`; UnknownWorkerCommand for anything else."""
    fn = WORKER_COMMANDS.get(cmd) if isinstance(cmd, str) else None
    if fn is None:
        raise UnknownWorkerCommand(f"a TP worker runs only {sorted(WORKER_COMMANDS)} and "
                                   f"{SHUTDOWN!r}; got {cmd!r}")
    return fn


def _worker_main(rank, size, port, config, hf_config, model_path, max_model_len, kernel_config,
                 handle, res_q, ppid, hooks=None):
    """A worker's life. `hooks`: None in production; tests install an object with
    started(rank) and received(rank, cmd) (tests/tp_hooks.py) to make a worker fail or hang."""
    threading.Thread(target=_exit_with_parent, args=(ppid,), daemon=True,
                     name="glassbox-parent-watch").start()
    try:
        if hooks is not None:
            hooks.started(rank)
        torch.set_num_threads(max(1, (os.cpu_count() or size) // size))
        if config.device.startswith("cuda"):
            torch.cuda.set_device(rank)
        tp, _store = make_group(rank, size, port, config.device)
        runner = ModelRunner(config, hf_config, model_path, max_model_len, tp, kernel_config)
        chan = ShmBroadcast.attach(handle)
        res_q.put(("ready", rank, None))
        while True:
            cmd, args = chan.recv(rank)
            if hooks is not None:
                hooks.received(rank, cmd)
            if cmd == SHUTDOWN:
                res_q.put(("bye", rank, None))
                os._exit(0)     # skip process-group destructors, which can block on exit
            out = worker_command(cmd)(runner, *args)
            if cmd in REPLYING_COMMANDS:
                res_q.put(("ok", rank, out))
    except BaseException:
        res_q.put(("error", rank, f"rank {rank}: {traceback.format_exc()}"))
        time.sleep(0.5)         # let the queue's feeder thread deliver it
        os._exit(1)


def _slot_bytes(config, max_model_len: int) -> int:
    """A broadcast slot holds the largest step message: flat token arrays, block tables,
    sampling settings and the probe plan, with room to spare."""
    blocks = (max_model_len + config.block_size - 1) // config.block_size + 1
    est = (config.max_num_batched_tokens * 8 * 4 + config.max_num_seqs * blocks * 4
           + config.max_num_seqs * 64)
    return max(4 << 20, 2 * est + (1 << 20))


class TPDriver:
    """The Runner protocol (engine/runner.py) over N ranks, and nothing more: rank 0's runner is
    local; the life-cycle commands go to every rank, the facts come from rank 0."""
    # tests install hooks here (a picklable object, see _worker_main); production leaves None
    worker_hooks = None
    # a step's inputs cross to the workers before its forward launches: its grammar mask must
    # be filled first (the engine core then drains the step in flight for guided requests)
    fills_masks_late = False

    def __init__(self, config, hf_config, model_path: str, max_model_len: int,
                 kernel_config: KernelConfig | None = None):
        self.size = n = config.tensor_parallel_size
        # settled here, on rank 0, and sent to every worker: the same kernels on every rank
        self._kernels = kernels = kernel_config if kernel_config is not None \
            else KernelConfig.build(config)
        self.procs: list = []
        self._results: list = []
        self.local: ModelRunner | None = None
        port = free_port()
        ctx = mp.get_context("spawn")
        # GPU ranks spin for a while between steps (a sleeping rank delays every collective of
        # the next step); CPU ranks share the cores with rank 0 and back off within 1 ms
        spin = 0.05 if config.device.startswith("cuda") else 1e-3
        self.chan = ShmBroadcast(n - 1, slot_bytes=_slot_bytes(config, max_model_len),
                                 spin_s=spin)
        self.res_q = ctx.Queue()
        for rank in range(1, n):
            p = ctx.Process(target=_worker_main, daemon=True, name=f"glassbox-tp{rank}",
                            args=(rank, n, port, config, hf_config, model_path, max_model_len,
                                  kernels, self.chan.handle(), self.res_q, os.getpid(),
                                  self.worker_hooks))
            p.start()
            self.procs.append(p)
        try:
            self.local = self._build_rank0(config, hf_config, model_path, max_model_len, port,
                                           kernels)
            ready = 0
            while ready < n - 1:
                kind, _, _ = self._next_result()
                ready += kind == "ready"
        except BaseException:
            self.shutdown()
            raise

    def _build_rank0(self, config, hf_config, model_path, max_model_len, port,
                     kernels: KernelConfig) -> ModelRunner:
        """Rank 0's group and runner, built on a thread while this one watches the workers: a
        worker that dies at start-up is reported at once, not after the store's timeout."""
        box: dict = {}

        def build():
            try:
                tp, box["store"] = make_group(0, self.size, port, config.device)
                box["runner"] = ModelRunner(config, hf_config, model_path, max_model_len, tp,
                                            kernels)
            except BaseException as e:      # noqa: BLE001 — re-raised on the caller's thread
                box["error"] = e
        # not a daemon: when a worker dies at start-up this raises at once, but the thread may
        # stay in a native call (the store waiting for the dead rank, up to its timeout; rank
        # 0's weights loading). The interpreter must wait for it at exit: a daemon thread that
        # comes back from a native call during teardown aborts the process (see llm.py's
        # _shutdown_at_exit)
        t = threading.Thread(target=build, daemon=False, name="glassbox-tp0-build")
        t.start()
        while t.is_alive():
            t.join(0.05)
            self.check_workers()
        if "error" in box:
            raise box["error"]
        self._store = box["store"]
        return box["runner"]

    # ---- facts: rank 0's -----------------------------------------------------------------------
    @property
    def model(self):
        return self.local.model if self.local is not None else None

    @property
    def kv_cache(self):
        return self.local.kv_cache if self.local is not None else None

    @property
    def device(self):
        return self.local.device

    @property
    def kernel_config(self) -> KernelConfig:
        return self._kernels

    @property
    def num_params(self) -> int:
        return self.local.num_params

    @property
    def moe_layers(self) -> list[int]:
        return self.local.moe_layers

    @property
    def bytes_per_block(self) -> int:
        return self.local.bytes_per_block

    def tp_layout(self) -> list:
        return self.local.tp_layout()

    def read_kv_block(self, block_id: int, layer: int, head: int, kv: int):
        """One of rank 0's KV heads (another rank's heads stay on its device)."""
        return self.local.read_kv_block(block_id, layer, head, kv)

    # ---- plumbing ------------------------------------------------------------------------------
    def check_workers(self) -> None:
        """Raise WorkerDiedError if a worker reported an error or exited."""
        while True:
            try:
                kind, rank, val = self.res_q.get_nowait()
            except queue.Empty:
                break
            if kind == "error":
                raise WorkerDiedError(f"tensor-parallel worker failed:\n{val}")
            self._results.append((kind, rank, val))
        for rank, p in enumerate(self.procs, start=1):
            if not p.is_alive():
                raise WorkerDiedError(f"tensor-parallel worker rank {rank} exited (code "
                                      f"{p.exitcode}); the engine cannot continue. Restart it.")

    def _next_result(self):
        while not self._results:
            self.check_workers()
            if not self._results:
                time.sleep(0.01)
        return self._results.pop(0)

    def _run(self, cmd: str, *args):
        run = worker_command(cmd)           # refused before anything is sent
        self.check_workers()
        self.chan.send((cmd, args), check=self.check_workers)
        try:
            return run(self.local, *args)
        except RuntimeError:          # a collective broke: most likely a worker died
            self.check_workers()
            raise

    # ---- life cycle: every rank ---------------------------------------------------------------
    def profile_num_blocks(self, max_num_batched_tokens: int, max_num_seqs: int) -> int:
        mine = self._run("profile_num_blocks", max_num_batched_tokens, max_num_seqs)
        # every rank must hold the same number of blocks: agree on the minimum
        theirs = []
        while len(theirs) < self.size - 1:
            kind, _, val = self._next_result()
            if kind == "ok":
                theirs.append(val)
        return min([mine] + theirs)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self._run("allocate_kv_cache", num_blocks)

    def capture_graphs(self, max_num_seqs: int) -> None:
        self._run("capture_graphs", max_num_seqs)

    def execute_step(self, inp):
        return self._run("execute_step", inp)

    def shutdown(self) -> None:
        procs, chan = self.procs, self.chan
        if chan is not None and any(p.is_alive() for p in procs):
            deadline = time.perf_counter() + 2.0

            def give_up():
                if time.perf_counter() > deadline or not all(p.is_alive() for p in procs):
                    raise TimeoutError
            try:
                chan.send((SHUTDOWN, ()), check=give_up)
            except (TimeoutError, ValueError):
                pass
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()
                p.join(timeout=2)
            if p.is_alive():            # ignores SIGTERM: no choice left
                p.kill()
                p.join(timeout=2)
        self.procs = []
        if chan is not None:
            chan.close()
            self.chan = None
        q = self.res_q
        if q is not None:
            q.close()
            q.join_thread()
            self.res_q = None
        if self.local is not None:
            self.local.shutdown()
