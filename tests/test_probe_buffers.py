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
    assert not graph_supports(plan(patterns={0: [(0, 4)]}), None)
    assert not graph_supports(plan(top_k=GRAPH_LENS_TOP_K + 1), None)
    assert not graph_supports(plan(rows=(1, 2)), None)              # a prefill chunk: eager


def test_host_results_do_not_alias_the_reused_transfer_buffer():
    """A CUDA graph's buffers, pinned copy included, are reused by the next step; what host()
    returns is kept in traces and step records, so it must be a copy (the expert load of every
    step once read as the last step's)."""
    bufs = ProbeBuffers(plan(), num_rows=4, num_layers=2, hidden=8, device="cpu",
                        dtype=torch.float32, moe_layers=[], num_experts=0, top_k=0)
    bufs.sumsq.copy_(torch.rand(3, 4) + 1)
    bufs.on_final(_NoModel())
    bufs.start_copy()
    first = bufs.host()
    np.testing.assert_allclose(first["norms"][:, 0], bufs.sumsq[:, 3].sqrt().numpy(), rtol=1e-6)
    kept = first["norms"].copy()
    bufs.packed.mul_(-1)            # the next replay overwrites the same buffers in place
    bufs.start_copy()
    second = bufs.host()
    np.testing.assert_array_equal(first["norms"], kept)
    np.testing.assert_array_equal(second["norms"], -kept)


class _NoModel:
    """on_final needs the model only for the lens and for TP gathers."""
    class lm_head:
        class tp:
            size = 1

            @staticmethod
            def all_gather_dim(x, dim):
                return x
