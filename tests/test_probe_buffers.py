"""ProbeBuffers' host side and the choice of probe-capturing CUDA graph, without a GPU."""
import numpy as np
import torch

from engine.probes.buffers import GRAPH_LENS_TOP_K, ProbeBuffers, graph_supports, graph_variant
from engine.probes.plan import ProbePlan, WatchedEntry
from engine.probes.spec import ProbeSpec


def plan(rows=(3,), last=(3,), lens=False, attention=(), entries=1, top_k=5, patterns=None):
    es = [WatchedEntry(f"r{i}", i, 3, 1, 10, True, ProbeSpec()) for i in range(entries)]
    return ProbePlan(entries=es, rows=list(rows), last_rows=list(last),
                     last_batch=[0] * len(last), norms=True, lens=lens, lens_top_k=top_k,
                     attention_layers=list(attention), routing=False, expert_load=False,
                     pattern_layers=patterns or {})


def test_graph_variant_keys_on_lens_and_attention_only():
    assert graph_variant(None) is None
    assert graph_variant(plan()) == (False, False)                 # norms/routing: base graph
    assert graph_variant(plan(lens=True)) == (True, False)
    assert graph_variant(plan(attention=[0, 2])) == (False, True)
    assert graph_variant(plan(lens=True, last=())) == (False, False)  # nothing samples: no lens


def test_graph_supports_one_watched_request_without_patterns():
    assert graph_supports(None, None)
    assert graph_supports(plan(), None)
    assert not graph_supports(plan(entries=2, rows=(1, 2), last=(1, 2)), None)
    assert not graph_supports(plan(patterns={0: [(0, 0, 4, 0)]}), None)
    assert not graph_supports(plan(top_k=GRAPH_LENS_TOP_K + 1), None)
    assert not graph_supports(plan(rows=(1, 2)), None)              # a prefill chunk: eager


def test_step_results_do_not_alias_the_graphs_reused_buffers():
    """A CUDA graph's buffers are overwritten by the next replay, which (overlap scheduling)
    runs before the host reads the step before: each step's ProbeResult must own its data."""
    bufs = ProbeBuffers(plan(), num_rows=4, num_layers=2, hidden=8, device="cpu",
                        dtype=torch.float32, moe_layers=[], num_experts=0, top_k=0)
    bufs.sumsq.copy_(torch.rand(3, 4) + 1)
    bufs.on_final(_NoModel())
    first = bufs.finish(None, [], 4)
    want = bufs.sumsq[:, 3].sqrt().numpy()
    bufs.packed.mul_(-1)            # the next replay overwrites the same buffers in place
    second = bufs.finish(None, [], 4)
    np.testing.assert_allclose(first.host()["norms"][:, 0], want, rtol=1e-6)
    np.testing.assert_allclose(second.host()["norms"][:, 0], -want, rtol=1e-6)


class _NoModel:
    """on_final needs the model only for the lens and for TP gathers."""
    class lm_head:
        class tp:
            size = 1

            @staticmethod
            def all_gather_dim(x, dim):
                return x
