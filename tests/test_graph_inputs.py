"""The decode graph's input layout, packed on the host without a GPU: what one step's two
host->device copies carry into the static buffers."""
import numpy as np

from engine.cuda_graphs import pack_graph_inputs
from engine.scheduler import ScheduledSeq
from engine.sampling import SamplingParams
from engine.sequence import Sequence
from engine.step_inputs import PENDING, build_step_inputs


def test_pack_graph_inputs_lays_out_rows_padding_tables_and_pending_ids():
    rng = np.random.default_rng()
    n, w, bs = 8, 6, 4
    seqs = []
    for i, length in enumerate(rng.integers(3, 20, 3)):
        s = Sequence(f"r{i}", rng.integers(3, 100, int(length)).tolist(), SamplingParams(), 0)
        s.block_table = rng.permutation(50)[:(int(length) + bs - 1) // bs].tolist()
        seqs.append(s)
    seqs[1].token_ids[-1] = PENDING                 # its input is still on the device
    seqs[1].pending[len(seqs[1]) - 1] = (7, 2)
    sched = [ScheduledSeq(s, 1, len(s) - 1) for s in seqs]
    inp = build_step_inputs(8, sched, bs, None, None, prev_step_id=7)
    a64 = np.full(3 * n + 2, 99, np.int64)
    a32 = np.full(n + 3 * w, 99, np.int32)
    pack_graph_inputs(inp, n, w, a64, a32)
    ids, pos, slots = a64[:3 * n].reshape(3, n)
    assert ids[:3].tolist() == [s.token_ids[-1] for s in seqs]
    assert pos[:3].tolist() == [len(s) - 1 for s in seqs]
    for i, s in enumerate(seqs):
        p = len(s) - 1
        assert slots[i] == s.block_table[p // bs] * bs + p % bs
    assert (ids[3:] == 0).all() and (pos[3:] == 0).all() and (slots[3:] == -1).all()
    assert a64[3 * n:].tolist() == [1, 2]            # flat row 1 takes sampled row 2 of step 7
    assert a32[:3].tolist() == [len(s) for s in seqs] and (a32[3:n] == 0).all()
    tables = a32[n:].reshape(3, w)
    for i, s in enumerate(seqs):
        assert tables[i, :len(s.block_table)].tolist() == s.block_table


def test_decode_graph_cap_is_the_smallest_bound_holding_the_longest_context():
    """DecodeGraphs.cap without a GPU: the bound a step replays, None past the largest or where a
    bucket has no bounds (its unbounded graph)."""
    from types import SimpleNamespace
    from engine.cuda_graphs import DecodeGraphs
    g = SimpleNamespace(caps={1: [256, 512], 2: [256], 8: []})
    cap = lambda bs, lens: DecodeGraphs.cap(g, bs, np.array(lens, dtype=np.int32))  # noqa: E731
    assert cap(1, [1]) == 256 and cap(1, [256]) == 256 and cap(1, [257]) == 512
    assert cap(1, [512]) == 512 and cap(1, [513]) is None
    assert cap(2, [10, 300]) is None and cap(2, [300, 10][1:]) == 256   # the longest row decides
    assert cap(8, [5]) is None and cap(1, []) is None
