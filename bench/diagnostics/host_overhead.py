"""Host time of one engine step with the forward stubbed out: scheduling, building inputs,
sampling bookkeeping, postprocessing and the step trace — the Python work that runs serially
with the GPU. Runs anywhere (no GPU, no weights).

    python bench/diagnostics/host_overhead.py --batch 256
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine.block_manager import BlockManager  # noqa: E402
from engine.engine_core import EngineCore  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402
from engine.scheduler import Scheduler  # noqa: E402
from engine.sampling import SamplingTensors, sample  # noqa: E402
from engine.sequence import Sequence  # noqa: E402
from engine.step_history import StepHistory  # noqa: E402
from engine.step_output import StepOutput  # noqa: E402


class StubRunner:
    """Samples from fixed logits of the right shape at once: only host work remains."""
    device = torch.device("cpu")
    fills_masks_late = False

    def check_workers(self) -> None:        # the Runner protocol: no worker processes here
        pass

    def __init__(self, vocab: int):
        self.logits = torch.randn(4096, vocab)

    def execute_step(self, inp):
        out = StepOutput(inp.step_id, None)
        if inp.sampling is not None:
            st = SamplingTensors.from_batch(inp.sampling, self.device)
            ids, *_ = sample(self.logits[:len(inp.sample_rows)], st)
            out.sampled_ids = out.sampled_host = ids
        return out


def main(batch: int = 256, steps: int = 50, vocab: int = 1000, seed: int = 0,
         temperature: float = 0.0, profile: bool = False, overlap: bool = True) -> dict:
    rng = random.Random(seed)
    bm = BlockManager(batch * 80, 16)
    sched = Scheduler(bm, batch, 8192, 4096, {0})
    core = EngineCore(StubRunner(vocab), sched, bm, None, {0}, StepHistory(256), overlap=overlap)
    for i in range(batch):
        n = rng.randint(100, 1000)
        core.add(Sequence(str(i), [rng.randint(1, vocab - 1) for _ in range(n)],
                          SamplingParams(temperature=temperature, max_tokens=4000, ignore_eos=True), i))
    while sched.waiting or any(s.num_computed_tokens < len(s.token_ids) - 1 for s in sched.running):
        core.step()                                   # prefill everything first
    times = []
    prof = None
    if profile:
        import cProfile
        prof = cProfile.Profile()
        prof.enable()
    for _ in range(steps):
        t = time.perf_counter()
        core.step()
        times.append(time.perf_counter() - t)
    if prof is not None:
        import pstats
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(20)
    med = statistics.median(times) * 1e3
    kind = "greedy" if temperature == 0 else f"T={temperature}"
    print(f"host time per decode step, {batch} requests ({kind}, stub forward): {med:.2f} ms "
          f"(median of {steps})")
    return {"batch": batch, "host_ms_per_step": med}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--profile", action="store_true", help="cProfile the timed steps")
    ap.add_argument("--serial", action="store_true", help="no overlap scheduling")
    a = ap.parse_args()
    main(a.batch, a.steps, temperature=a.temperature, profile=a.profile, overlap=not a.serial)
