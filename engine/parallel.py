"""Tensor parallelism across N processes: rank 0 lives in the calling process (the UI's),
ranks 1..N-1 are spawned workers. Each engine gets its own TCPStore on a free port and its
own process group object (gloo on CPU, NCCL on GPU), so two engines never collide.

Rank 0 sends every command (profile, allocate, capture, step) to the workers through a queue
and runs it itself at the same time; the collectives inside the forward keep them in step.
A worker that dies is noticed before the next step (and a broken collective raises), so rank 0
reports it within seconds instead of hanging.
"""
from __future__ import annotations

import datetime
import os
import pickle
import socket
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .errors import WorkerDiedError
from .model_runner import ModelRunner
from .parallel_state import TPGroup

_TIMEOUT = datetime.timedelta(seconds=int(os.environ.get("GLASSBOX_TP_TIMEOUT_S", "60")))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_group(rank: int, size: int, port: int, device: str) -> TPGroup:
    store = dist.TCPStore("127.0.0.1", port, size, is_master=rank == 0, timeout=_TIMEOUT)
    if device.startswith("cuda"):
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = _TIMEOUT
        pg = dist.ProcessGroupNCCL(store, rank, size, opts)
    else:
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = _TIMEOUT
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        pg = dist.ProcessGroupGloo(store, rank, size, opts)
    return TPGroup(rank, size, pg), store


def _worker_main(rank, size, port, config, hf_config, model_path, max_model_len, cmd_q, res_q):
    try:
        torch.set_num_threads(max(1, (os.cpu_count() or size) // size))
        if config.device.startswith("cuda"):
            torch.cuda.set_device(rank)
        tp, _store = make_group(rank, size, port, config.device)
        runner = ModelRunner(config, hf_config, model_path, max_model_len, tp)
        res_q.put(("ready", rank))
        while True:
            cmd, args = pickle.loads(cmd_q.get())
            if cmd == "shutdown":
                res_q.put(("bye", rank))
                os._exit(0)     # skip process-group destructors, which can block on exit
            out = getattr(runner, cmd)(*args)
            if cmd in ("profile_num_blocks",):
                res_q.put(("ok", out))
    except BaseException:
        res_q.put(("error", f"rank {rank}: {traceback.format_exc()}"))


class TPDriver:
    """The ModelRunner interface over N ranks; rank 0's runner is local."""

    def __init__(self, config, hf_config, model_path: str, max_model_len: int):
        self.size = n = config.tensor_parallel_size
        port = free_port()
        ctx = mp.get_context("spawn")
        self.cmd_qs, self.res_qs, self.procs = [], [], []
        for rank in range(1, n):
            cq, rq = ctx.Queue(), ctx.Queue()
            p = ctx.Process(target=_worker_main, daemon=True, name=f"glassbox-tp{rank}",
                            args=(rank, n, port, config, hf_config, model_path, max_model_len,
                                  cq, rq))
            p.start()
            self.cmd_qs.append(cq)
            self.res_qs.append(rq)
            self.procs.append(p)
        try:
            tp, self._store = make_group(0, n, port, config.device)
            self.local = ModelRunner(config, hf_config, model_path, max_model_len, tp)
            for rank in range(1, n):
                self._result(rank)
        except BaseException:
            self.shutdown()
            raise

    def __getattr__(self, name):          # facts and read-only state come from rank 0
        return getattr(self.__dict__["local"], name)

    # ---- plumbing ------------------------------------------------------------------------------
    def check_workers(self) -> None:
        for rank, p in enumerate(self.procs, start=1):
            if not p.is_alive():
                raise WorkerDiedError(f"tensor-parallel worker rank {rank} exited (code "
                                      f"{p.exitcode}); the engine cannot continue. Restart it.")

    def _result(self, rank: int):
        import queue
        q = self.res_qs[rank - 1]
        while True:
            try:
                kind, val = q.get(timeout=1.0)
            except queue.Empty:
                self.check_workers()
                continue
            if kind == "error":
                raise WorkerDiedError(f"tensor-parallel worker failed:\n{val}")
            return val

    def _broadcast(self, cmd: str, *args) -> None:
        self.check_workers()
        # plain pickle, by value: a multiprocessing queue would move tensors into shared
        # memory from its feeder thread while this rank's forward is still reading them
        msg = pickle.dumps((cmd, args))
        for q in self.cmd_qs:
            q.put(msg)

    def _run(self, cmd: str, *args):
        self._broadcast(cmd, *args)
        try:
            return getattr(self.local, cmd)(*args)
        except RuntimeError:          # a collective broke: most likely a worker died
            self.check_workers()
            raise

    # ---- the ModelRunner interface --------------------------------------------------------------
    def profile_num_blocks(self, max_num_batched_tokens: int, max_num_seqs: int) -> int:
        mine = self._run("profile_num_blocks", max_num_batched_tokens, max_num_seqs)
        # every rank must hold the same number of blocks: agree on the minimum
        return min([mine] + [self._result(r) for r in range(1, self.size)])

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self._run("allocate_kv_cache", num_blocks)

    def capture_graphs(self, max_num_seqs: int) -> None:
        self._run("capture_graphs", max_num_seqs)

    def execute_step(self, inp):
        return self._run("execute_step", inp)

    def last_step_info(self) -> dict:
        # the probes store the step's expert load on the runner they see: this driver
        info = dict(self.local.last_step_info())
        info["expert_load"] = self.__dict__.get("_expert_load")
        return info

    def shutdown(self) -> None:
        for q in getattr(self, "cmd_qs", []):
            try:
                q.put(pickle.dumps(("shutdown", ())))
            except Exception:
                pass
        for p in getattr(self, "procs", []):
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()
                p.join(timeout=2)
        for q in getattr(self, "cmd_qs", []) + getattr(self, "res_qs", []):
            q.close()
            q.join_thread()
        # spawn-context queues hold named semaphores in /dev/shm that are unlinked when the
        # queue objects are collected: drop them now so shutdown leaves nothing behind
        self.cmd_qs, self.res_qs, self.procs = [], [], []
        import gc
        gc.collect()
        local = self.__dict__.get("local")
        if local is not None:
            local.shutdown()
