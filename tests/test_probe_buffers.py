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
    first = bufs.finish(None, bufs.plan, [], 4)
    want = bufs.sumsq[:, 3].sqrt().numpy()
    bufs.packed.mul_(-1)            # the next replay overwrites the same buffers in place
    second = bufs.finish(None, bufs.plan, [], 4)
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


def test_attention_rows_follow_the_steps_plan_not_the_graphs_template():
    """A CUDA graph's buffers were captured with a template plan (no entries): the rows each
    step hands to the host are chosen by that step's plan (found on the H200: graph steps
    returned no attention rows)."""
    from engine.probes.result import queue_attention_rows
    template = plan(attention=[0, 1], entries=0)
    bufs = ProbeBuffers(template, num_rows=4, num_layers=2, hidden=8, device="cpu",
                        dtype=torch.float32, moe_layers=[], num_experts=0, top_k=0)
    bufs.attn_probs = torch.rand(2, 1, 3, 16)                  # [A, W, Hq, max_ctx]
    step = plan(attention=[1], entries=1)
    step.entries[0].spec = ProbeSpec(layers=(1,))
    step.entries[0].block_table = [5, 6, 7]
    rows = queue_attention_rows(bufs, step, block_size=4)
    assert len(rows) == 1 and rows[0].layers == [1]
    pos = step.entries[0].start_pos                            # 10: one token at 10
    torch.testing.assert_close(rows[0].probs, bufs.attn_probs[[1], 0, :, :pos + 1])
    assert rows[0].block_table == [5, 6, 7]
    assert queue_attention_rows(bufs, template, block_size=4) == []
