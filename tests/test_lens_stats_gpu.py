"""GPU: the logit lens' statistics kernel compiled, at Qwen3-0.6B's lens shape (28 layers, the
151,936-token vocabulary, bf16 logits), against its torch reference, and inside a CUDA graph."""
import pytest
import torch

from engine.kernels.lens_stats import lens_stats, lens_stats_ref, sampled_stats

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("k", [1, 5, 10])
def test_kernel_equals_reference_bf16_at_qwen_shape(k):
    torch.manual_seed(k)
    x = (torch.randn(28, 151936, device="cuda") * 4).to(torch.bfloat16)
    got, want = lens_stats(x, k), lens_stats_ref(x, k)
    # bf16 logits tie often: compare the chosen logits, in order
    assert torch.equal(x.gather(1, got["top_i"].long()), x.gather(1, want["top_i"].long()))
    for name in ("top_p", "entropy", "lse"):
        torch.testing.assert_close(got[name], want[name], rtol=2e-5, atol=1e-6)


def test_replays_in_a_cuda_graph_and_feeds_sampled_stats():
    x = torch.empty(28, 151936, device="cuda", dtype=torch.bfloat16)
    x.copy_(torch.randn_like(x, dtype=torch.float32) * 3)
    lens_stats(x, 10)                           # compile outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = lens_stats(x, 10)
    for seed in range(3):
        torch.manual_seed(seed)
        x.copy_(torch.randn_like(x, dtype=torch.float32) * 3)
        g.replay()
        want = lens_stats_ref(x, 10)
        torch.testing.assert_close(out["entropy"], want["entropy"], rtol=2e-5, atol=1e-6)
        tokens = torch.tensor([123], device="cuda")
        prob, rank = sampled_stats(x.view(28, 1, -1), out["lse"].view(28, 1), tokens)
        p = x.float().softmax(-1)[:, 123]
        torch.testing.assert_close(prob[:, 0], p, rtol=1e-4, atol=1e-7)
        assert torch.equal(rank[:, 0], (x > x[:, 123:124]).sum(-1).float())
