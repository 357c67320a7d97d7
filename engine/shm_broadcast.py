"""ShmBroadcast: rank 0's per-step messages to the other ranks through shared memory.

A ring of slots in one SharedMemory segment, one writer (rank 0), N readers (the workers). The
writer waits until every reader has acked a slot's previous message, writes the payload and its
length, then publishes the slot's sequence number, which readers poll. No pipes, no feeder
thread, no pickled queue on the hot path (what made TP=2 slower than TP=1): a message is one
memcpy, seen within microseconds by a busy reader (idle readers back off to sleeps).

Memory ordering: a reader that sees the new sequence number must see the payload stored before
it (and the writer, seeing an ack, must know that reader is done with the slot). x86-64's total
store order guarantees this, and CPython cannot reorder the stores (each is an opaque C call).
Weakly ordered CPUs (ARM, POWER, RISC-V) may not, and Python has no fence, so the ring refuses
them (`check_platform`) rather than hand a worker half a message; a port would need a release
store and an acquire load (a small C extension).
"""
from __future__ import annotations

import pickle
import platform
import time
from multiprocessing import shared_memory

import numpy as np

from .errors import InvalidArgumentError

# machines whose memory model the ring's ordering argument (above) holds on
PROVEN_MACHINES = frozenset({"x86_64", "amd64", "AMD64"})


def check_platform(machine: str | None = None) -> None:
    """Refuse a CPU whose store ordering the ring was not proven on (see the module's doc)."""
    machine = platform.machine() if machine is None else machine
    if machine not in PROVEN_MACHINES:
        raise InvalidArgumentError(
            f"tensor parallelism's shared-memory step broadcast relies on x86-64's store "
            f"ordering and has not been proven on this {machine or 'unknown'} CPU, where a "
            f"worker could read half a message; use tensor_parallel_size=1 here, or run "
            f"tensor parallelism on an x86-64 host", "tensor_parallel_size")


_HEADER = 2          # int64s per slot: sequence number, payload length


class ShmBroadcast:
    def __init__(self, num_readers: int, slot_bytes: int = 4 << 20, num_slots: int = 4,
                 name: str | None = None, spin_s: float = 1e-3):
        check_platform()        # before any shared memory exists: nothing to clean up
        self.num_readers, self.slot_bytes, self.num_slots = num_readers, slot_bytes, num_slots
        self.slot_stride = _HEADER * 8 + slot_bytes
        size = num_slots * self.slot_stride + num_readers * num_slots * 8
        self.owner = name is None      # the writer owns (and unlinks) the segment
        # readers attach (spawned workers share the writer's resource tracker, so their
        # registration on attach is the writer's own and is undone by its unlink)
        self.shm = shared_memory.SharedMemory(name=name, create=self.owner, size=size)
        buf = self.shm.buf
        self.acks = np.ndarray((num_readers, num_slots), dtype=np.int64, buffer=buf,
                               offset=num_slots * self.slot_stride)
        self.heads = [np.ndarray((_HEADER,), dtype=np.int64, buffer=buf,
                                 offset=i * self.slot_stride) for i in range(num_slots)]
        if self.owner:
            for h in self.heads:
                h[:] = (-1, 0)
            self.acks[:] = -1
        self.seq = 0            # next message number (writer), or next expected (reader)
        # how long a waiting side yield-spins before it backs off to sleeps: on a GPU machine
        # the next step's message comes within ~1-30 ms, and a reader asleep when it arrives
        # delays its rank's launch, which every all-reduce of the step then waits for
        self.spin_s = spin_s

    @property
    def name(self) -> str:
        return self.shm.name

    def handle(self) -> tuple:
        """What a reader process needs to attach."""
        return (self.num_readers, self.slot_bytes, self.num_slots, self.shm.name, self.spin_s)

    @classmethod
    def attach(cls, handle: tuple) -> "ShmBroadcast":
        n, slot_bytes, num_slots, name, spin_s = handle
        return cls(n, slot_bytes, num_slots, name, spin_s)

    # ---- writer --------------------------------------------------------------------------------
    def send(self, obj, check=None) -> None:
        """Publish obj to every reader. `check()` is called while waiting for a slot (raise
        there to stop waiting, e.g. when a reader died)."""
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        if len(data) > self.slot_bytes:
            raise ValueError(f"a step message of {len(data)} bytes exceeds the broadcast slot "
                             f"({self.slot_bytes} bytes)")
        slot = self.seq % self.num_slots
        prev = self.seq - self.num_slots
        if prev >= 0:
            _wait(lambda: bool((self.acks[:, slot] >= prev).all()), check, self.spin_s)
        off = slot * self.slot_stride + _HEADER * 8
        self.shm.buf[off:off + len(data)] = data
        head = self.heads[slot]
        head[1] = len(data)
        head[0] = self.seq              # publish last: in order on x86-64 (module doc)
        self.seq += 1

    # ---- reader --------------------------------------------------------------------------------
    def recv(self, rank: int, check=None):
        """The next message for reader `rank` (1-based rank of the worker -> index rank - 1)."""
        slot = self.seq % self.num_slots
        head = self.heads[slot]
        _wait(lambda: head[0] == self.seq, check, self.spin_s)
        off = slot * self.slot_stride + _HEADER * 8
        obj = pickle.loads(self.shm.buf[off:off + int(head[1])])
        self.acks[rank - 1, slot] = self.seq
        self.seq += 1
        return obj

    def close(self) -> None:
        self.acks = self.heads = None   # drop views into the buffer before closing it
        try:
            self.shm.close()
            if self.owner:
                self.shm.unlink()
        except (FileNotFoundError, BufferError):
            pass


def _wait(ready, check, spin_s: float = 1e-3, check_every_s: float = 0.2) -> None:
    """Poll `ready()`: yield-spin for spin_s, then sleep in growing steps up to 2 ms."""
    if ready():
        return
    t0 = last = time.perf_counter()
    pause = 0.0
    while not ready():
        now = time.perf_counter()
        if check is not None and now - last > check_every_s:
            check()
            last = now
        if now - t0 > spin_s:
            pause = min(2e-3, max(pause * 2, 20e-6))
        time.sleep(pause)

