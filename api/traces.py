"""Export a watched request's trace over HTTP: the files `RequestTrace.export` writes (an .npz
keyed by TransformerLens hook names and a .json of token ids and layout), zipped."""
from __future__ import annotations

import io
import tempfile
import zipfile
from pathlib import Path

from .errors import APIError


def trace_zip(llm, request_id: str) -> bytes:
    """`<id>.npz` + `<id>.json` in a zip; `RequestTrace.load` reads the pair back. Blocking
    (it takes the engine lock): call it from a worker thread."""
    try:
        trace = llm.trace(request_id)
    except KeyError as e:
        raise APIError(404, str(e.args[0] if e.args else e), "request_id",
                       "trace_not_found") from None
    with tempfile.TemporaryDirectory(prefix="glassbox-trace-") as tmp:
        npz = trace.export(Path(tmp) / f"{request_id}.npz")
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as zf:   # npz is compressed already
            zf.write(npz, npz.name)
            zf.write(npz.with_suffix(".json"), npz.with_suffix(".json").name)
    return buf.getvalue()
