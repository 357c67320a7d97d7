"""Device rows to host memory off the engine's stream: pinned staging on a side CUDA stream,
waited on with a blocking event. Used by the attention store (engine/probes/attention_store.py)
and by a reader that shows one step's rows (AttentionStep in engine/probes/trace.py).
"""
from __future__ import annotations

import contextlib

import numpy as np

_SIDE = None


def side_stream():
    """One CUDA stream for moving finished rows to the host (None without CUDA): its copies
    never queue behind the engine's launched steps, whose outputs they do not need."""
    global _SIDE
    import torch
    if _SIDE is None and torch.cuda.is_available():
        _SIDE = torch.cuda.Stream()
    return _SIDE


def rows_to_host(rows, stream) -> np.ndarray:
    """One device tensor to a read-only host array, through pinned staging on `stream`."""
    import torch
    if rows.device.type != "cuda":
        out = rows.numpy()
    else:
        with (torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()):
            staging = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
            staging.copy_(rows, non_blocking=True)
            done = torch.cuda.Event(blocking=True)
            done.record()
        done.synchronize()
        out = staging.numpy().copy()
    out.flags.writeable = False
    return out


def move_to_host(steps: list, stream) -> None:
    """Many steps' rows to the host in one copy: joined on the device, copied once into a
    pinned staging buffer (returned to torch's cache afterwards, so it is reused, not
    re-pinned), then into ordinary memory. On `stream` (a side stream) the copy does not queue
    behind the engine's work: the rows were written by steps the engine has already waited for."""
    pairs = [(st, st.device_rows) for st in steps]      # read once: a reader may move one
    pairs = [(st, rows) for st, rows in pairs if rows is not None]
    if not pairs:
        return
    import torch
    if pairs[0][1].device.type != "cuda":
        for st, rows in pairs:
            st.set_host(rows.numpy())
        return
    with (torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()):
        flat = torch.cat([rows.reshape(-1) for _, rows in pairs]) if len(pairs) > 1 else \
            pairs[0][1].reshape(-1)
        staging = torch.empty(flat.numel(), dtype=flat.dtype, pin_memory=True)
        staging.copy_(flat, non_blocking=True)
        done = torch.cuda.Event(blocking=True)     # the waiter sleeps: no spinning in the
        done.record()                             # driver beside the engine thread's launches
    done.synchronize()
    host = staging.numpy().copy()
    del staging, flat
    off = 0
    for st, rows in pairs:
        n = rows.numel()
        st.set_host(host[off:off + n].reshape(tuple(rows.shape)))
        off += n
