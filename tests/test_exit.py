"""A program that ends while an engine is still working exits cleanly. Without the engine's
exit hook, its daemon loop thread is caught inside a torch call by the interpreter's teardown
and the process aborts ("terminate called without an active exception", status 134) in about
two runs of three, after the program itself had finished: engine/llm.py's _shutdown_at_exit."""
from __future__ import annotations

import os
import subprocess
import sys

_BUSY_AT_EXIT = """
import sys, time
sys.path.insert(0, {root!r})
from engine import LLM, SamplingParams
llm = LLM({path!r}, device="cpu", block_size=4)
events = []
llm.submit([5, 6, 7], SamplingParams(max_tokens=100000, ignore_eos=True),
           on_event=events.append)
while len(events) < 3:          # the engine is mid-generation when the program ends
    time.sleep(0.01)
print("leaving", flush=True)
"""


def test_a_program_that_exits_while_an_engine_generates_exits_cleanly(qwen3_dir, tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = tmp_path / "busy.py"
    script.write_text(_BUSY_AT_EXIT.format(root=root, path=qwen3_dir))
    for _ in range(2):              # the abort was intermittent: each run is a fresh chance
        r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                           timeout=300, env=dict(os.environ))
        assert "leaving" in r.stdout, r.stderr[-2000:]
        assert r.returncode == 0, f"exit status {r.returncode}: {r.stderr[-2000:]}"
