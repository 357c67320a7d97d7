"""StepOutput: what one launched step returns — a value, not side channels on the runner.

`execute_step` returns at once with the step's work queued on the device: the sampled ids stay
there (the next step reads its pending input ids from them), and their host copies are on their
way (non-blocking, into pinned memory). `wait()` blocks until the step is done; after it the
host fields can be read. On the CPU everything is done when execute_step returns.

StepEvents: the CUDA events a step records (timing start / end, done), from a ring made once,
recorded on a stream looked up by device index. Why: a host-bound batch-1 decode step spent
~0.1 ms of its ~1.1 ms host time creating three events and, in `Event.record()` with no stream,
looking up the current stream through torch's CUDA-availability checks in Python
(bench/results/2026-12-02b-guided-profile-*). Reuse is safe: a triple comes back only after its
last step's `done` completed (at most two steps are in flight, the ring holds eight, and a
pending triple is replaced rather than re-recorded), and a step's GPU time is read into a float
when its wait ends, before its triple can be recorded again.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass
class StepOutput:
    step_id: int
    sampled_ids: torch.Tensor | None        # [S] int64 on the device (None: no row sampled)
    # host copies, filled by the device -> host copy; read only after wait()
    sampled_host: torch.Tensor | None = None     # [S] int64 (pinned on a GPU)
    logprobs_host: tuple | None = None      # (chosen [S] fp32, top ids [S, k], top lps [S, k])
    # prompt logprobs of the step's prompt rows (StepInputs.prompt_lp_rows), host copies:
    # (chosen [R] fp32, rank [R] int64, top ids [R, k], top lps [R, k]); None when not asked
    prompt_logprobs_host: tuple | None = None
    probes: object | None = None            # probes.result.ProbeResult, or None
    graph_bucket: int | None = None         # decode batch or prefill token bucket; None: eager
    cascade: bool = False                   # the forward ran cascade attention (engine/cascade.py)
    collectives: int = 0                    # collectives issued by the forward (TP)
    collective_timer: object | None = None  # parallel_state.CollectiveTimer of this step
    t_launch: float = 0.0                   # host seconds to stage inputs and launch
    done: object | None = None              # torch.cuda.Event recorded after the last copy
    gpu_start: object | None = None         # timing events around the forward + sampling
    gpu_end: object | None = None
    # steering-vector requests (engine/interventions): per-row sums of the captured residual
    resid_captures: object | None = None
    _gpu_time: float | None = None          # read from the events when the wait ends

    def wait(self, poll=None, interval_s: float = 0.5, idle=None) -> float:
        """Block until the step's device work and copies are done; seconds waited. `poll` is
        called every `interval_s` while waiting (TP: notice a dead worker instead of hanging
        in a collective that will never complete); `idle`, if given, at every turn of the
        wait (the engine hands a waiting reader its snapshot there: the host is idle anyway)."""
        if self.done is None:
            return 0.0
        t0 = time.perf_counter()
        if poll is None and idle is None:
            self.done.synchronize()
        else:
            last = t0
            if idle is not None:
                # once even when the device is already done: a host-bound engine (the wait
                # below never turns) still hands a waiting reader its snapshot here, halfway
                # through its step cycle, not only at the boundary after postprocessing
                idle()
            while not self.done.query():
                now = time.perf_counter()
                if poll is not None and now - last >= interval_s:
                    poll()
                    last = now
                if idle is not None:
                    idle()
                # yield at first (a step usually ends within a few ms), then back off
                time.sleep(0 if now - t0 < 2e-3 else 50e-6)
        self._read_gpu_time()
        return time.perf_counter() - t0

    def _read_gpu_time(self) -> None:
        # now, while the events are this step's: the runner records them again for a later
        # step (StepEvents)
        if self.gpu_start is not None and self._gpu_time is None:
            self._gpu_time = self.gpu_start.elapsed_time(self.gpu_end) / 1e3

    @property
    def tokens(self) -> list[int]:
        return self.sampled_host.tolist() if self.sampled_host is not None else []

    @property
    def gpu_time(self) -> float | None:
        """Device seconds from the forward's start to the end of sampling (after wait())."""
        self._read_gpu_time()
        return self._gpu_time

    @property
    def collective_time(self) -> float | None:
        """Measured seconds spent in collectives this step (None when not measured)."""
        return self.collective_timer.total() if self.collective_timer is not None else None


RING = 8


class StepEvents:
    def __init__(self, device: torch.device):
        self.device_index = device.index if device.index is not None else \
            torch.cuda.current_device()
        self._ring = [self._new() for _ in range(RING)]
        self._next = 0

    @staticmethod
    def _new() -> tuple:
        return (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True),
                torch.cuda.Event())

    def take(self) -> tuple:
        """(start, end, done) for the next step: none of them pending on the device."""
        i = self._next
        self._next = (i + 1) % RING
        trio = self._ring[i]
        if not trio[2].query():          # still in flight (never, at two steps in flight)
            trio = self._ring[i] = self._new()
        return trio

    def stream(self) -> torch.cuda.Stream:
        """The current stream, looked up by index (no availability checks in Python)."""
        return torch.cuda.current_stream(self.device_index)
