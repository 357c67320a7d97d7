"""The fused sampling kernel (engine/kernels/sampling_kernel.py) against its torch reference, run
in Triton's interpreter on a CPU (tests/conftest.py sets TRITON_INTERPRET) or compiled where CUDA
is present; and the reference against the torch sampler and against softmax(l / T).

The interpreter pays a few milliseconds per program and per nested @triton.jit call, so shapes
stay small: each (row, vocabulary chunk) is one program."""
import pytest
import torch

from engine.kernels.sampling_kernel import gumbel_argmax, gumbel_argmax_ref, uniform_debug
from engine.sampling import SamplingParams, SamplingTensors, sample, uniform_noise

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
I64 = dict(dtype=torch.int64, device=DEVICE)

# found by scanning uniform_noise: for seed 682 at position 7, token 2574's top hash bits are all
# ones. With 24 bits, 2**24 - 1 + 0.5 rounded to 2**24 in fp32: u == 1.0, E = -log u = 0, and the
# token won every draw whatever its probability. With 23 bits it is the largest u below 1.
U_ONE = dict(seed=682, position=7, token=2574)

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy: log(0), inf - inf


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _rows(n: int):
    """Random seeds (the full int64 range) and positions for n rows."""
    seeds = torch.randint(-2**63, 2**63 - 1, (n,), **I64)
    return seeds, torch.randint(0, 1 << 40, (n,), **I64)


TEMPS = [0.0, 1.0, 0.35, 2.5, 0.0, 1.3]   # greedy rows mixed in


def _inputs(vocab: int, dtype, scale: float = 1.5):
    b = len(TEMPS)
    logits = (torch.randn(b, vocab, device=DEVICE) * scale).to(dtype)
    seeds, positions = _rows(b)
    return logits, torch.tensor(TEMPS, device=DEVICE), seeds, positions


# ---- the noise ------------------------------------------------------------------------------
def test_kernel_uniforms_equal_uniform_noise_bit_for_bit():
    seeds, positions = _rows(5)
    seeds[:3] = torch.tensor([-2**63, 2**63 - 1, 0])         # sign bit set, all ones, zero
    positions[0] = 0
    got, want = uniform_debug(seeds, positions, 3001), uniform_noise(seeds, positions, 3001)
    assert torch.equal(got, want)
    assert got.min() > 0 and got.max() < 1 and got.unique().numel() > 2900   # not degenerate
    # the all-ones corner stays strictly below 1 in both
    s, p = torch.tensor([U_ONE["seed"]], **I64), torch.tensor([U_ONE["position"]], **I64)
    got = uniform_debug(s, p, 4096)
    assert torch.equal(got, uniform_noise(s, p, 4096))
    assert got[0, U_ONE["token"]] == 1 - 2**-24


# ---- kernel == reference --------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("vocab,block", [(1000, 128), (3001, 512), (3001, None)])
def test_kernel_tokens_equal_reference(dtype, vocab, block):
    logits, temp, seeds, positions = _inputs(vocab, dtype)
    got = gumbel_argmax(logits, temp, seeds, positions, block=block)
    want = gumbel_argmax_ref(logits, temp, seeds, positions)
    assert got.dtype == torch.int64 and torch.equal(got, want)
    greedy = logits.float().argmax(-1)
    assert torch.equal(got[temp == 0], greedy[temp == 0])
    assert (got[temp > 0] != greedy[temp > 0]).any()        # the noise does move sampled rows


def test_kernel_tokens_equal_reference_over_many_rows():
    # logits spread about as much as the noise, so the winner of most rows is contested: a slip
    # in the noise (a bit of the hash, a rounding step, even a 10% scale, which acts like a
    # temperature change) moves some of these 64 tokens
    n = 64
    logits = torch.randn(n, 256, device=DEVICE) * 2.0
    temp = torch.rand(n, device=DEVICE) + 0.5
    seeds, positions = _rows(n)
    got = gumbel_argmax(logits, temp, seeds, positions, block=256)
    assert torch.equal(got, gumbel_argmax_ref(logits, temp, seeds, positions))
    assert (got != logits.argmax(-1)).sum() > n // 4


def test_kernel_reads_strided_logits():
    logits, temp, seeds, positions = _inputs(1000, torch.float32)
    want = gumbel_argmax_ref(logits, temp, seeds, positions)
    wide = torch.full((len(TEMPS), 1037), float("nan"), device=DEVICE)
    wide[:, 30:1030] = logits
    view = wide[:, 30:1030]                                  # row stride 1037, poisoned margins
    assert torch.equal(gumbel_argmax(view, temp, seeds, positions, block=256), want)
    cols = logits.t().contiguous().t()                       # column stride != 1: copied first
    assert torch.equal(gumbel_argmax(cols, temp, seeds, positions, block=256), want)


def test_draw_depends_only_on_seed_position_and_row():
    logits, temp, seeds, positions = _inputs(1000, torch.float32)
    batch = gumbel_argmax(logits, temp, seeds, positions, block=256)
    for r in (1, 3):
        alone = gumbel_argmax(logits[r:r + 1], temp[r:r + 1], seeds[r:r + 1], positions[r:r + 1])
        assert alone.item() == batch[r].item()
    # other rows around it, another order, another chunking: the same tokens
    extra, _, extra_seeds, extra_pos = _inputs(1000, torch.float32)
    order = torch.tensor([4, 0, 5, 2, 3, 1], device=DEVICE)
    mixed = gumbel_argmax(torch.cat([extra[:2], logits[order]]), torch.cat([temp[:2], temp[order]]),
                          torch.cat([extra_seeds[:2], seeds[order]]),
                          torch.cat([extra_pos[:2], positions[order]]), block=128)
    assert torch.equal(mixed[2:], batch[order])
    # and a different seed or position is a different draw (for some row of a hot vocabulary)
    assert not torch.equal(gumbel_argmax(logits, temp, seeds + 1, positions, block=256), batch)
    assert not torch.equal(gumbel_argmax(logits, temp, seeds, positions + 1, block=256), batch)


def test_ties_minus_inf_and_nan_resolve_like_the_reference():
    v, inf = 700, float("inf")
    logits = torch.randn(6, v, device=DEVICE)
    logits[0, [100, 650]] = 9.0                              # greedy tie across chunks: lowest id
    logits[1] = -inf                                         # all banned: id 0, like torch.argmax
    logits[2] = -inf
    logits[3] = -inf
    logits[3, 555] = -4.0                                    # the one allowed token is drawn
    logits[4, :50] = float("nan")                            # NaN never drawn
    logits[5, 600:] = inf                                    # +inf ties: lowest id among them
    temp = torch.tensor([0.0, 0.0, 1.0, 0.8, 1.0, 0.0], device=DEVICE)
    seeds, positions = _rows(6)
    got = gumbel_argmax(logits, temp, seeds, positions, block=256)
    assert torch.equal(got, gumbel_argmax_ref(logits, temp, seeds, positions))
    assert got[:4].tolist() == [100, 0, 0, 555] and got[4] >= 50 and got[5] == 600


def test_all_ones_hash_matches_reference_and_never_picks_a_banned_token():
    # the largest u: the biggest noise there is; on a -inf (banned) logit it must still lose
    s, p = torch.tensor([U_ONE["seed"]] * 2, **I64), torch.tensor([U_ONE["position"]] * 2, **I64)
    logits = torch.randn(2, 4096, device=DEVICE)
    logits[0, U_ONE["token"]] = float("-inf")
    temp = torch.ones(2, device=DEVICE)
    got = gumbel_argmax(logits, temp, s, p)
    assert torch.equal(got, gumbel_argmax_ref(logits, temp, s, p))
    assert got[0] != U_ONE["token"]


# ---- the reference is the sampler's draw, and follows softmax(l / T) -------------------------
def test_reference_draws_what_the_torch_sampler_draws():
    logits, temp, seeds, positions = _inputs(1000, torch.float32)
    logits = logits.cpu()
    params = [SamplingParams(temperature=t) for t in TEMPS]
    banned = [(1, int(logits[1].argmax())), (2, 5)]
    t = SamplingTensors.build(params, seeds.tolist(), positions.tolist(), banned, "cpu")
    masked = logits.clone()
    masked[[r for r, _ in banned], [c for _, c in banned]] = float("-inf")
    want = gumbel_argmax_ref(masked, t.temperature, t.seeds, t.positions)
    assert torch.equal(sample(logits, t)[0], want)           # the CPU path: softmax, race
    assert want[1] != banned[0][1]


def _chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(tokens.cpu(), minlength=probs.numel()).double()
    expected = probs.double().cpu() * tokens.numel()
    return float(((counts - expected) ** 2 / expected).sum())


LOGITS5 = [1.0, 0.2, -0.5, 2.0, 0.7]
CHI2_DF4_ALPHA001 = 18.467


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_draws_follow_softmax_over_temperature(temperature):
    l = torch.tensor(LOGITS5, device=DEVICE)
    probs = torch.softmax(l / temperature, -1)
    # many draws through the reference (cheap), a few hundred through the kernel (interpreted);
    # fixed seeds make both deterministic, and a wrong temperature or noise is far outside
    for fn, n in ((gumbel_argmax_ref, 20000), (gumbel_argmax, 250)):
        seeds = torch.arange(n, **I64) * 7919 + 3
        tokens = fn(l.expand(n, 5), torch.full((n,), temperature, device=DEVICE), seeds,
                    torch.full((n,), 11, **I64))
        assert _chi_square(tokens, probs) < CHI2_DF4_ALPHA001, fn.__name__
