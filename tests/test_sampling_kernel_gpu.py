"""GPU: the fused sampling kernel against its torch reference at Qwen's vocabulary, compiled, and
engine.sampling.sample taking it for plain temperature batches."""
import pytest
import torch

from engine.kernels import sampling_kernel
from engine.kernels.sampling_kernel import gumbel_argmax, gumbel_argmax_ref, uniform_debug
from engine.sampling import SamplingParams, SamplingTensors, sample, uniform_noise

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

VOCAB = 151936
I64 = dict(dtype=torch.int64, device="cuda")
# the hash of all ones: u was 1.0 here with 24 bits; 23 bits give the largest uniform below 1
U_ONE = dict(seed=682, position=7, token=2574)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _rows(n: int):
    return (torch.randint(-2**63, 2**63 - 1, (n,), **I64), torch.randint(0, 1 << 40, (n,), **I64))


def test_kernel_uniforms_equal_uniform_noise_bit_for_bit():
    seeds, positions = _rows(7)
    seeds[0], positions[0] = U_ONE["seed"], U_ONE["position"]
    got = uniform_debug(seeds, positions, VOCAB)
    assert torch.equal(got, uniform_noise(seeds, positions, VOCAB))
    assert got[0, U_ONE["token"]] == 1 - 2**-24
    assert got.max() < 1 and got.min() > 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("batch", [1, 7, 128])
def test_kernel_tokens_equal_reference(dtype, batch):
    logits = (torch.randn(batch, VOCAB, device="cuda") * 2.5).to(dtype)   # bf16: many exact ties
    temp = torch.rand(batch, device="cuda") * 1.5 + 0.2
    temp[1::3] = 0.0                                                       # greedy rows mixed in
    seeds, positions = _rows(batch)
    got = gumbel_argmax(logits, temp, seeds, positions)
    assert torch.equal(got, gumbel_argmax_ref(logits, temp, seeds, positions))
    # the same rows through another chunking agree too
    assert torch.equal(gumbel_argmax(logits, temp, seeds, positions, block=4096), got)


def test_kernel_tokens_equal_reference_on_a_strided_view():
    wide = torch.randn(9, VOCAB + 64, device="cuda", dtype=torch.bfloat16)
    logits = wide[:, 32:32 + VOCAB]
    temp = torch.full((9,), 0.7, device="cuda")
    seeds, positions = _rows(9)
    assert torch.equal(gumbel_argmax(logits, temp, seeds, positions),
                       gumbel_argmax_ref(logits, temp, seeds, positions))


def test_ties_minus_inf_nan_and_u_one_resolve_like_the_reference():
    inf = float("inf")
    logits = torch.randn(7, VOCAB, device="cuda")
    logits[0, [1000, 150000]] = 20.0            # greedy tie across chunks: lowest id
    logits[1] = -inf                            # all banned: id 0
    logits[2] = -inf
    logits[3] = -inf
    logits[3, 99999] = -3.0                     # the one allowed token
    logits[4, :5000] = float("nan")             # NaN never drawn
    logits[5, 140000:] = inf                    # +inf ties: lowest id
    logits[6, U_ONE["token"]] = -inf            # banned where u is largest: never drawn
    temp = torch.tensor([0.0, 0.0, 1.0, 0.8, 1.0, 0.9, 1.0], device="cuda")
    seeds, positions = _rows(7)
    seeds[6], positions[6] = U_ONE["seed"], U_ONE["position"]
    got = gumbel_argmax(logits, temp, seeds, positions)
    assert torch.equal(got, gumbel_argmax_ref(logits, temp, seeds, positions))
    assert got[:4].tolist() == [1000, 0, 0, 99999]
    assert got[4] >= 5000 and got[5] == 140000 and got[6] != U_ONE["token"]


def test_sample_uses_the_kernel_for_plain_temperature_batches(monkeypatch):
    calls = []
    real = sampling_kernel.gumbel_argmax
    monkeypatch.setattr(sampling_kernel, "gumbel_argmax", lambda *a, **k: calls.append(1) or real(*a, **k))
    b = 16
    logits = torch.randn(b, VOCAB, device="cuda") * 2
    params = [SamplingParams(temperature=0.0 if i % 4 == 0 else 0.9, logprobs=2) for i in range(b)]
    seeds, positions = (torch.randint(0, 2**40, (b,)).tolist() for _ in range(2))
    banned = [(1, int(logits[1].argmax())), (2, 7)]
    t = SamplingTensors.build(params, seeds, positions, banned, "cuda")
    tokens, lp, top_ids, _ = sample(logits, t)
    assert calls == [1]
    masked = logits.clone()
    masked[[1, 2], [banned[0][1], 7]] = float("-inf")
    assert torch.equal(tokens, gumbel_argmax_ref(masked, t.temperature, t.seeds, t.positions))
    assert tokens[1] != banned[0][1]
    assert torch.equal(lp, torch.log_softmax(masked, -1).gather(-1, tokens[:, None])[:, 0])
    assert top_ids.shape == (b, 2)
    # a top-p row sends the batch down the torch path
    t = SamplingTensors.build(params[:-1] + [SamplingParams(top_p=0.9)], seeds, positions, [], "cuda")
    sample(logits, t)
    assert calls == [1]


def test_penalty_kernel_equals_its_torch_reference_at_qwen_vocab_compiled():
    """The count-penalty kernel (presence, frequency, repetition), compiled, against its torch
    reference on fresh counts; rows without penalties untouched bit for bit."""
    from engine.kernels.penalties_kernel import apply_count_penalties, apply_count_penalties_ref
    S, B = 6, 5
    counts = torch.randint(0, 4, (S, VOCAB), dtype=torch.int32, device="cuda")
    seen = torch.rand(S, VOCAB, device="cuda") < 0.01
    rows = torch.tensor([4, 0, 2], device="cuda")
    slot_ids = torch.tensor([5, 1, 1], device="cuda")
    pres, freq = torch.randn(3, device="cuda"), torch.randn(3, device="cuda")
    rep = torch.rand(3, device="cuda") + 0.5
    logits = torch.randn(B, VOCAB, device="cuda") * 3
    want = apply_count_penalties_ref(logits.clone(), rows, slot_ids, counts, seen, pres, freq, rep)
    got = apply_count_penalties(logits.clone(), rows, slot_ids, counts, seen, pres, freq, rep)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(got[1], logits[1]) and torch.equal(got[3], logits[3])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bitmask_kernel_equals_reference_at_qwen_vocab(dtype):
    from engine.guided import apply_bitmask_ref
    from engine.kernels.bitmask_kernel import apply_bitmask_kernel
    g = torch.Generator(device="cuda").manual_seed(11)
    B, V = 5, 151936
    logits = (torch.randn(B, V, generator=g, device="cuda") * 3).to(dtype)
    words = (151646 + 31) // 32          # a tokenizer narrower than the model's vocabulary
    mask = torch.randint(-(1 << 31), 1 << 31, (B, words), generator=g, device="cuda",
                         dtype=torch.int64).to(torch.int32)
    assert torch.equal(apply_bitmask_kernel(logits, mask), apply_bitmask_ref(logits, mask))
