"""The logit lens' statistics kernel (engine/kernels/lens_stats.py) against its torch reference
in Triton's interpreter, and the reference against an independent softmax, top-k and entropy.
Shapes stay small: each (row, vocabulary chunk) is one interpreted program."""
import pytest
import torch

from engine.kernels.lens_stats import (BLOCK_V, MAX_K, lens_stats, lens_stats_ref, sampled_stats,
                                       sampled_stats_ref)


def _logits(rows: int, vocab: int, dtype, scale: float = 3.0) -> torch.Tensor:
    return (torch.randn(rows, vocab) * scale).to(dtype)


def _check(x: torch.Tensor, got: dict, want: dict, k: int) -> None:
    assert got["top_i"].shape == want["top_i"].shape == (want["entropy"].shape[0], k)
    # equal logits (fp16 has many) may come in either order from torch.topk: the same values in
    # the same order, and the kernel's ids ascending within a run of equal values
    vals = x.gather(1, got["top_i"].long())
    assert torch.equal(vals, x.gather(1, want["top_i"].long()))
    ids = got["top_i"]
    assert bool(((vals[:, 1:] < vals[:, :-1]) | (ids[:, 1:] > ids[:, :-1])).all())
    for name in ("top_p", "entropy", "lse"):
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rows,vocab,k,dtype", [
    (3, 1000, 5, torch.float32),                 # one chunk, a partial one
    (2, 2 * BLOCK_V + 777, 10, torch.float16),   # three chunks, the last partial
    (4, BLOCK_V, 1, torch.float32),              # exactly one full chunk
])
def test_kernel_equals_reference(triton_interpreter, rows, vocab, k, dtype):
    x = _logits(rows, vocab, dtype)
    _check(x, lens_stats(x, k), lens_stats_ref(x, k), k)


def test_top_k_across_chunks_and_ties_go_to_the_lowest_id(triton_interpreter):
    """The row's largest logits sit in different chunks (the merge must pick across them), and
    equal logits in two chunks rank the lower id first, as torch.topk's stable order would."""
    vocab = 2 * BLOCK_V + 100
    x = torch.randn(2, vocab)
    hot = [5, BLOCK_V + 3, 2 * BLOCK_V + 50, BLOCK_V - 1]
    x[0, hot] = torch.tensor([9.0, 11.0, 10.0, 8.0])
    x[1, [7, BLOCK_V + 7, 2 * BLOCK_V + 7]] = 12.0           # a three-way tie
    got = lens_stats(x, 4)
    assert got["top_i"][0].tolist() == [BLOCK_V + 3, 2 * BLOCK_V + 50, 5, BLOCK_V - 1]
    assert got["top_i"][1, :3].tolist() == [7, BLOCK_V + 7, 2 * BLOCK_V + 7]
    torch.testing.assert_close(got["top_p"][1, 0], got["top_p"][1, 2])


def test_large_k_takes_the_reference_not_the_unrolled_kernel(monkeypatch):
    """k past MAX_K would unroll the top-k loop k times: the torch path serves it."""
    from engine.kernels import lens_stats as mod

    class Refuse:
        def __getitem__(self, grid):
            raise AssertionError("the kernel ran for k > MAX_K")
    monkeypatch.setattr(mod, "_chunk_kernel", Refuse())
    x = _logits(2, 300, torch.float32)
    got = lens_stats(x, MAX_K + 1)
    assert got["top_i"].shape == (2, MAX_K + 1)
    _check(x, got, lens_stats_ref(x, MAX_K + 1), MAX_K + 1)
    with pytest.raises(AssertionError, match="kernel ran"):
        lens_stats(x, MAX_K)


def test_reference_is_softmax_top_k_and_entropy():
    x = _logits(5, 777, torch.float64).float()
    ref = lens_stats_ref(x, 6)
    dist = torch.distributions.Categorical(logits=x.double())
    p = dist.probs
    top_p, top_i = p.sort(dim=-1, descending=True)
    assert torch.equal(ref["top_i"].long(), top_i[:, :6])
    torch.testing.assert_close(ref["top_p"].double(), top_p[:, :6], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(ref["entropy"].double(), dist.entropy(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ref["lse"].double(), torch.logsumexp(x.double(), -1))


def test_sampled_stats_are_the_sampled_tokens_probability_and_rank():
    L, W, V = 3, 2, 500
    x = torch.randn(L, W, V) * 2
    tokens = torch.tensor([17, 400])
    lse = torch.logsumexp(x, -1)
    prob, rank = sampled_stats_ref(x, lse, tokens)
    p = x.softmax(-1)
    for l in range(L):
        for w in range(W):
            t = int(tokens[w])
            torch.testing.assert_close(prob[l, w], p[l, w, t])
            # rank 0 = the lens' top guess: how many tokens the lens puts above the sampled one
            assert int(rank[l, w]) == int((p[l, w] > p[l, w, t]).sum())
    top = x.argmax(-1)
    _, rank = sampled_stats_ref(x, lse, top[0])
    assert rank[0].tolist() == [0, 0]


@pytest.mark.parametrize("L,W,V,dtype", [
    (3, 2, 1000, torch.float32),                 # one partial chunk
    (2, 3, 2 * BLOCK_V + 77, torch.float16),     # three chunks; fp16 ties the sampled logit often
])
def test_sampled_stats_kernel_equals_the_reference(triton_interpreter, L, W, V, dtype):
    """One pass over the logits, each chunk adding its count of larger logits to the row's
    rank: the reference's probability, and its rank exactly (ties do not count as larger)."""
    x = (torch.randn(L, W, V) * 3).to(dtype)
    x[:, :, 5] = x[:, :, 9]                      # a tie with the sampled token in every row
    tokens = torch.tensor([9] + torch.randint(0, V, (W - 1,)).tolist())
    lse = torch.logsumexp(x.float(), -1)
    prob, rank = sampled_stats(x, lse, tokens)
    want_p, want_r = sampled_stats_ref(x, lse, tokens)
    assert prob.dtype == rank.dtype == torch.float32 and prob.shape == rank.shape == (L, W)
    assert torch.equal(rank, want_r)
    torch.testing.assert_close(prob, want_p, rtol=1e-6, atol=1e-8)
