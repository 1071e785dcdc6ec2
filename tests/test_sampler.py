import math

import pytest
import torch

from moe_kernels.cumsum import cumsum_ref
from moe_runtime.sampling_params import MAX_TEMPERATURE, SamplingParams
from moe_runtime.seeds import derive_seed, resolve_seed
from moe_runtime.worker import sampler as sampler_module
from moe_runtime.worker.sampler import Sampler
from moe_runtime.worker.step_input import SampleResult
from tests.invariance import in_fresh_processes


@pytest.fixture
def sampler() -> Sampler:
    return Sampler(lambda x: torch.log_softmax(x.float(), -1), cumsum_ref)


@pytest.fixture
def logits() -> torch.Tensor:
    generator = torch.Generator().manual_seed(1234)
    return torch.randn(6, 50, generator=generator) * 3


def _same(a: SampleResult, b: SampleResult) -> bool:
    # Python float equality on values read from fp32 tensors is a bit comparison (no NaN here).
    return (
        a.token_id == b.token_id
        and a.logprob == b.logprob
        and list(a.top_logprobs.items()) == list(b.top_logprobs.items())
    )


def test_derive_seed_stable_and_distinct():
    """Stable: a restarted job (fresh processes, Python's str hash salted otherwise) derives
    the same seeds; comparing derive_seed(7, 0) with itself in one process could not fail.
    Control: a salted hash does differ between those processes."""
    parts = [(7, 0), (7, 1), (0,), (2**62, 5, 9)]
    here = [derive_seed(*p) for p in parts]
    setup = "from moe_runtime.seeds import derive_seed"
    assert in_fresh_processes(setup, f"[derive_seed(*p) for p in {parts}]") == [here, here]
    salted = in_fresh_processes("", "hash('7/0')")
    assert salted[0] != salted[1], "the processes' str hashes agree: the check could not fail"
    seeds = {derive_seed(7, i) for i in range(1000)} | {derive_seed(i, 7) for i in range(8, 1000)}
    assert len(seeds) == 1000 + 992
    assert all(0 <= s < 2**63 for s in seeds)
    with pytest.raises(ValueError, match="derive_seed"):
        derive_seed(-1)


def test_resolve_seed():
    assert resolve_seed(42) == 42
    fresh = {resolve_seed(None) for _ in range(10)}
    assert len(fresh) == 10 and all(0 <= s < 2**63 for s in fresh)


def test_greedy_is_argmax_with_raw_logprobs(sampler, logits):
    params = SamplingParams(temperature=0.0, logprobs=3, logprobs_mode="processed")
    results = sampler.sample(logits, [params] * 6, [0] * 6, [0] * 6)
    raw = torch.log_softmax(logits, -1)
    for i, r in enumerate(results):
        assert r.token_id == int(torch.argmax(logits[i]))
        assert r.logprob == raw[i, r.token_id].item()
        assert list(r.top_logprobs) == torch.topk(raw[i], 3).indices.tolist()


@pytest.mark.parametrize("temperature", [1e-6, 1e-40, 1e-45])
def test_a_temperature_too_small_to_divide_by_is_greedy(sampler, logits, temperature):
    """Below GREEDY_TEMPERATURE a temperature is greedy: 1e-40 in float32 is subnormal, and
    logits divided by it were +-inf, so the draw took the first inf instead of the argmax."""
    params = SamplingParams(temperature=temperature, seed=5)
    assert params.is_greedy
    results = sampler.sample(logits, [params] * 6, [0] * 6, [0] * 6)
    assert [r.token_id for r in results] == torch.argmax(logits, -1).tolist()
    # The control: divided anyway, as the sampler did, 1e-40 loses the argmax.
    scaled = logits / torch.tensor([1e-40])
    assert torch.argmax(scaled, -1).tolist() != torch.argmax(logits, -1).tolist()


@pytest.mark.parametrize("temperature", [math.inf, math.nan, -1e-9, True])
def test_temperature_must_be_a_finite_number(temperature):
    with pytest.raises(ValueError, match="temperature must be a finite number"):
        SamplingParams(temperature=temperature)


def test_a_temperature_past_float32_is_refused(sampler, logits):
    """The sampler divides by the temperature in float32, where 1e39 is inf: the logits were 0
    and a held-off id's -inf NaN, which argmax takes, so every draw was EOS before min_tokens."""
    with pytest.raises(ValueError, match="temperature must be a finite number"):
        SamplingParams(temperature=1e39)
    sampler = Sampler(lambda x: torch.log_softmax(x.float(), -1), cumsum_ref, eos_token_ids=(EOS,))
    params = SamplingParams(temperature=MAX_TEMPERATURE, min_tokens=2, logprobs=2)
    draws = [sampler.sample(logits[:1], [params], [s], [0])[0] for s in range(20)]
    assert all(d.token_id != EOS and math.isfinite(d.logprob) for d in draws)
    assert len({d.token_id for d in draws}) > 5  # logits / 3.4e38: about uniform
    # The control: the -inf of a held-off id divided by 1e39 in float32 is NaN.
    assert torch.isnan(torch.tensor([float("-inf")]) / torch.tensor([1e39])).all()


def test_ties_go_to_lower_id(sampler):
    row = torch.tensor([[0.0, 5.0, 1.0, 5.0, 5.0, -1.0]])
    greedy = sampler.sample(row, [SamplingParams(temperature=0.0, logprobs=4)], [0], [0])[0]
    assert greedy.token_id == 1
    assert list(greedy.top_logprobs) == [1, 3, 4, 2]
    # top_k=2 among three tied maxima keeps ids 1 and 3, never 4.
    params = SamplingParams(temperature=1.0, top_k=2)
    tokens = {sampler.sample(row, [params], [s], [0])[0].token_id for s in range(200)}
    assert tokens == {1, 3}


def test_batch_invariance(sampler, logits):
    """A row's result does not depend on the other rows or on where it sits in the batch."""
    _assert_batch_invariant(sampler, logits)


def test_batch_invariance_negative_control(sampler, logits, monkeypatch):
    """Noise drawn for the batch from one generator (seeded by its first row, as a sampler
    without per-row streams does) gives a row other bits alone than in the batch: the
    comparison can fail."""

    def batch_drawn_noise(seeds, positions, vocab_size, device):
        generator = torch.Generator().manual_seed(seeds[0])
        u = torch.rand(len(seeds), vocab_size, generator=generator).clamp_(1e-7, 1 - 1e-7)
        return -torch.log(-torch.log(u))

    monkeypatch.setattr(sampler_module, "gumbel_noise", batch_drawn_noise)
    with pytest.raises(AssertionError):
        _assert_batch_invariant(sampler, logits)


def _assert_batch_invariant(sampler, logits):
    params = [
        SamplingParams(temperature=0.8, top_p=0.9, top_k=20, logprobs=5),
        SamplingParams(temperature=1.3, logprobs=5, logprobs_mode="processed"),
        SamplingParams(temperature=0.0, logprobs=2),
        SamplingParams(temperature=0.5, top_k=3, logprobs=0),
        SamplingParams(temperature=1.0, top_p=0.5, logprobs=7, logprobs_mode="processed"),
        SamplingParams(temperature=2.0),
    ]
    seeds = [11, 22, 33, 44, 55, 66]
    positions = [0, 5, 9, 1, 100, 3]
    full = sampler.sample(logits, params, seeds, positions)
    for i in range(6):
        alone = sampler.sample(logits[i : i + 1].clone(), [params[i]], [seeds[i]], [positions[i]])
        assert _same(alone[0], full[i])
    perm = [3, 5, 0, 4, 2, 1]
    permuted = sampler.sample(
        logits[perm],
        [params[j] for j in perm],
        [seeds[j] for j in perm],
        [positions[j] for j in perm],
    )
    for k, j in enumerate(perm):
        assert _same(permuted[k], full[j])
    # Other rows replaced by different logits: row 0 still the same.
    mixed = torch.cat([logits[:1], torch.randn(3, 50)])
    again = sampler.sample(mixed, [params[0]] * 4, [seeds[0], 1, 2, 3], [positions[0], 7, 8, 9])
    assert _same(again[0], full[0])


def test_seed_and_position_change_the_draw(sampler):
    row = torch.zeros(1, 64)  # uniform: every token equally likely
    params = SamplingParams(temperature=1.0)
    by_seed = [sampler.sample(row, [params], [s], [0])[0].token_id for s in range(200)]
    by_position = [sampler.sample(row, [params], [5], [p])[0].token_id for p in range(200)]
    assert len(set(by_seed)) > 40 and len(set(by_position)) > 40
    repeat = [sampler.sample(row, [params], [s], [0])[0].token_id for s in range(200)]
    assert repeat == by_seed


def test_frequencies_match_softmax(sampler):
    """Chi-square over 4000 seeded draws; 18.47 is the 0.999 quantile for 4 degrees of freedom."""
    temperature = 0.7
    row = torch.tensor([[1.0, 0.5, 0.0, -0.5, 2.0]])
    num_draws = 4000
    params = SamplingParams(temperature=temperature)
    counts = torch.zeros(5)
    results = sampler.sample(
        row.expand(num_draws, 5).contiguous(),
        [params] * num_draws,
        list(range(num_draws)),
        [3] * num_draws,
    )
    for r in results:
        counts[r.token_id] += 1

    def chi2(t: float) -> float:
        expected = torch.softmax(row[0] / t, -1) * num_draws
        return float(((counts - expected) ** 2 / expected).sum())

    assert chi2(temperature) < 18.47
    assert chi2(1.0) > 18.47  # control: the test can tell the temperature apart


def test_top_k_never_leaves_the_top_k(sampler, logits):
    params = SamplingParams(temperature=5.0, top_k=4)
    allowed = set(torch.topk(logits[2], 4).indices.tolist())
    tokens = {sampler.sample(logits[2:3], [params], [s], [0])[0].token_id for s in range(300)}
    assert tokens <= allowed and len(tokens) > 1


def test_top_p_keeps_the_nucleus(sampler):
    # probs 0.5, 0.3, 0.15, 0.05: top_p=0.75 needs the first two (0.5 < 0.75 <= 0.8).
    probs = torch.tensor([0.15, 0.5, 0.05, 0.3])
    row = probs.log()[None]
    params = SamplingParams(temperature=1.0, top_p=0.75, logprobs=4, logprobs_mode="processed")
    results = [sampler.sample(row, [params], [s], [0])[0] for s in range(300)]
    assert {r.token_id for r in results} == {1, 3}
    top = results[0].top_logprobs
    assert math.isclose(math.exp(top[1]), 0.5 / 0.8, rel_tol=1e-5)
    assert top[0] == top[2] == -math.inf
    # A tiny top_p keeps the first token only.
    tiny = SamplingParams(temperature=1.0, top_p=0.01)
    assert {sampler.sample(row, [tiny], [s], [0])[0].token_id for s in range(50)} == {1}


def test_top_p_mass_comes_from_the_table_cumsum():
    # The prefix sum is the op table's (an exact integer scan in invariant mode), never torch's.
    rows_seen = []

    def cumsum(x):
        rows_seen.append(x.shape)
        return cumsum_ref(x)

    sampler = Sampler(lambda x: torch.log_softmax(x, -1), cumsum)
    row = torch.tensor([[0.15, 0.5, 0.05, 0.3]]).log()
    sampler.sample(row, [SamplingParams(temperature=1.0, top_p=0.75)], [0], [0])
    assert rows_seen == [torch.Size([1, 4])]
    sampler.sample(row, [SamplingParams(temperature=1.0, top_k=2)], [0], [0])
    assert len(rows_seen) == 1  # top-k alone needs no prefix sum
    # A step's top-p rows share one prefix-sum call (one launch on the rows' device).
    params = [
        SamplingParams(temperature=1.0, top_p=0.75),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=2.0, top_k=3),
        SamplingParams(temperature=0.5, top_p=0.9, top_k=3),
    ]
    sampler.sample(row.expand(4, 4).contiguous(), params, [0, 1, 2, 3], [0, 0, 0, 0])
    assert rows_seen[1:] == [torch.Size([2, 4])]


def test_raw_and_processed_logprobs(sampler, logits):
    raw = SamplingParams(temperature=0.5, logprobs=3, seed=9)
    processed = SamplingParams(temperature=0.5, logprobs=3, seed=9, logprobs_mode="processed")
    a, b = sampler.sample(logits[:2], [raw, processed], [9, 9], [4, 4])
    b_alone = sampler.sample(logits[:1], [processed], [9], [4])[0]
    assert a.token_id == b_alone.token_id  # the mode changes what is reported, not the draw
    assert a.logprob == torch.log_softmax(logits[0], -1)[a.token_id].item()
    assert b_alone.logprob == torch.log_softmax(logits[0] / 0.5, -1)[a.token_id].item()
    assert a.logprob != b_alone.logprob
    assert b.top_logprobs != {}


def test_no_top_logprobs_when_not_asked(sampler, logits):
    for logprobs in (None, 0):
        r = sampler.sample(logits[:1], [SamplingParams(logprobs=logprobs)], [1], [0])[0]
        assert r.top_logprobs == {}


def test_rejects_mismatched_inputs(sampler, logits):
    with pytest.raises(ValueError, match="one params/seed"):
        sampler.sample(logits, [SamplingParams()], [0], [0])
    with pytest.raises(ValueError, match="fp32"):
        sampler.sample(logits.double(), [SamplingParams()] * 6, [0] * 6, [0] * 6)


def test_gumbel_noise_is_splitmix64_of_seed_position_and_id():
    """Known answers from an arbitrary-precision splitmix64 (the int64 tensor ops must wrap)
    and libm's fp64 logs, w strictly inside (0, 1), and each row a function of its own (seed,
    position) only."""
    from moe_runtime.worker.sampler import gumbel_noise

    mask = (1 << 64) - 1

    def mix(z: int) -> int:
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 & mask
        z = (z ^ (z >> 27)) * 0x94D049BB133111EB & mask
        return z ^ (z >> 31)

    seeds, positions, vocab = [0, 123456789, (1 << 63) - 1], [0, 5, 1000], 70
    noise = gumbel_noise(seeds, positions, vocab, torch.device("cpu"))
    for r, (seed, position) in enumerate(zip(seeds, positions, strict=True)):
        key = mix((seed + 0x9E3779B97F4A7C15 * (position + 1)) & mask)
        for v in (0, 1, 69):
            bits = mix((key + 0x9E3779B97F4A7C15 * (v + 1)) & mask) >> 12
            u = 1.0 - (bits + 0.5) * 2.0**-52  # exact in Python's float (fp64)
            expected = torch.tensor(-math.log(-math.log(u)), dtype=torch.float32)
            assert noise[r, v] == expected, (r, v)
    assert torch.isfinite(noise).all()
    alone = gumbel_noise(seeds[1:2], positions[1:2], vocab, torch.device("cpu"))
    assert torch.equal(alone[0], noise[1])
    assert not torch.equal(noise[0], noise[1])


def test_gumbel_noise_reaches_the_far_tail():
    """The noise's upper tail P(noise > t) over its grid of draws equals the Gumbel law's
    1 - exp(-exp(-t)) within 1% up to t = 30, so a token up to 30 nats below the top is drawn
    at its probability; from 23 bits (u = (k + 0.5) / 2**23 in fp32, the sampler before) the
    same count finds nothing past 16.7 (a token 20 nats below was never drawn): the check can
    fail. The grid's two ends are finite."""
    from moe_runtime.worker.sampler import NOISE_BITS, noise_from_bits

    def tail(noise_of, num_bits: int, t: float) -> float:
        """P(noise > t) over the 2**num_bits draws: the noise falls as the bits grow, so the
        draws above t are those below the first k whose noise is <= t (bisection)."""
        low, high = 0, 1 << num_bits
        while low < high:
            mid = (low + high) // 2
            if float(noise_of(torch.tensor([mid]))[0]) > t:
                low = mid + 1
            else:
                high = mid
        return low / 2.0**num_bits

    def old_noise(bits):
        u = (bits.float() + 0.5) * 2.0**-23
        return -torch.log(-torch.log(u))

    ends = noise_from_bits(torch.tensor([0, (1 << NOISE_BITS) - 1]))
    assert torch.isfinite(ends).all() and ends[0] > 36.5 and ends[1] > -3.7, ends
    for t in (5.0, 17.0, 20.0, 25.0, 30.0):
        exact = -math.expm1(-math.exp(-t))
        assert tail(noise_from_bits, NOISE_BITS, t) == pytest.approx(exact, rel=1e-2), t
    assert tail(old_noise, 23, 20.0) == 0.0  # the control: the 23-bit grid ends below 20


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_gumbel_noise_rows_ignore_the_batch():
    """On CUDA (rows hashed 32 at a time): a row's noise alone equals its noise among 70 rows,
    at any place; the CPU's noise is the same but where libdevice's and libm's fp64 logs part
    by an ulp across an fp32 rounding (at most one fp32 ulp, in a few entries of 307,200)."""
    from moe_runtime.worker.sampler import gumbel_noise

    cuda, cpu, vocab = torch.device("cuda"), torch.device("cpu"), 102400
    seeds, positions = list(range(1000, 1070)), list(range(70))
    batch = gumbel_noise(seeds, positions, vocab, cuda)
    for r in (0, 31, 32, 69):
        alone = gumbel_noise(seeds[r : r + 1], positions[r : r + 1], vocab, cuda)
        assert torch.equal(alone[0], batch[r]), r
    host = gumbel_noise(seeds[:3], positions[:3], vocab, cpu)
    device = batch[:3].cpu()
    differ = device != host
    assert differ.sum() <= 8, int(differ.sum())
    ulps = (device.view(torch.int32) - host.view(torch.int32)).abs()
    assert ulps.max() <= 1, int(ulps.max())


def _argmax_cases(device: torch.device) -> list[torch.Tensor]:
    """Wide rows (split and not) with ties inside a part, across parts and at the last
    column, -inf runs and a width off the part grid."""
    from moe_runtime.worker.sampler import ARGMAX_PART, ARGMAX_SPLIT_MIN

    gen = torch.Generator().manual_seed(3)
    cases = []
    for width in (ARGMAX_SPLIT_MIN - 1, ARGMAX_SPLIT_MIN, 40000, 102400):
        x = torch.randn(6, width, generator=gen).round(decimals=1)  # many exact ties
        x[1, :] = 0.0
        x[2, ARGMAX_PART - 1] = x[2, ARGMAX_PART] = x[2, width - 1] = 99.0
        x[3, width - 1] = 99.0
        x[4, : width // 2] = float("-inf")
        x[5, ARGMAX_PART * 3 + 7] = x[5, ARGMAX_PART * 5] = 50.0
        cases.append(x.to(device))
    return cases


def test_row_argmax_equals_torch_argmax():
    """The parts' argmax is torch.argmax's index exactly, ties to the lower id, on the CPU."""
    from moe_runtime.worker.sampler import row_argmax

    for x in _argmax_cases(torch.device("cpu")):
        assert torch.equal(row_argmax(x), torch.argmax(x, dim=-1)), x.shape
        assert torch.equal(row_argmax(x[2:3]), torch.argmax(x[2:3], dim=-1))
    # Control: the last part's maximum alone (a wrong combination) differs on these rows.
    x = _argmax_cases(torch.device("cpu"))[2]
    assert not torch.equal(x[:, -2048:].argmax(dim=-1), torch.argmax(x, dim=-1))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_row_argmax_equals_torch_argmax():
    from moe_runtime.worker.sampler import row_argmax

    for x in _argmax_cases(torch.device("cuda")):
        assert torch.equal(row_argmax(x), torch.argmax(x, dim=-1)), x.shape
        for r in range(x.shape[0]):
            assert torch.equal(row_argmax(x[r : r + 1]), torch.argmax(x[r : r + 1], dim=-1)), r


EOS = 7


def test_min_tokens_holds_off_eos_and_stop_ids_until_its_position(logits):
    """Before min_tokens the row's EOS and stop ids are -inf in what it samples from (a greedy
    row whose argmax is EOS takes the next best); from min_tokens on nothing is held. Raw
    logprobs are the model's own (EOS keeps its logprob among the tops); processed ones are of
    the distribution sampled from (EOS at -inf)."""
    sampler = Sampler(lambda x: torch.log_softmax(x.float(), -1), cumsum_ref, eos_token_ids=(EOS,))
    row = logits[:1].clone()
    row[0, EOS] = row.max() + 5.0  # greedy picks EOS
    second = int(torch.argsort(row[0], descending=True, stable=True)[1])
    greedy = SamplingParams(temperature=0.0, logprobs=3, min_tokens=2)
    assert sampler.sample(row, [greedy], [0], [2])[0].token_id == EOS  # at min_tokens: free
    held = sampler.sample(row, [greedy], [0], [1])[0]
    assert held.token_id == second
    assert held.logprob == torch.log_softmax(row[0], -1)[second].item()  # raw: unmasked
    assert EOS in held.top_logprobs
    ignoring = SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True)
    assert sampler.sample(row, [ignoring], [0], [0])[0].token_id == EOS  # EOS is no stop then
    by_id = SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True, stop_token_ids=[EOS])
    assert sampler.sample(row, [by_id], [0], [0])[0].token_id == second
    processed = SamplingParams(
        temperature=1.0, logprobs=3, min_tokens=1, stop_token_ids=[second],
        logprobs_mode="processed",
    )  # fmt: skip
    draws = [sampler.sample(row, [processed], [s], [0])[0] for s in range(50)]
    assert not {d.token_id for d in draws} & {EOS, second}
    masked = row.clone()
    masked[0, [EOS, second]] = float("-inf")
    want = torch.log_softmax(masked[0], -1)
    assert all(d.logprob == want[d.token_id].item() for d in draws)
    assert all(EOS not in d.top_logprobs and second not in d.top_logprobs for d in draws)


def _held_off_params() -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0.0, logprobs=5, min_tokens=9, stop_token_ids=[3, 4]),
        SamplingParams(temperature=0.8, top_p=0.9, logprobs=5, logprobs_mode="processed"),
        SamplingParams(temperature=1.3, logprobs=5, min_tokens=3, logprobs_mode="processed"),
        SamplingParams(temperature=0.0, logprobs=2),
        SamplingParams(temperature=0.5, top_k=3, logprobs=2, min_tokens=1, stop_token_ids=[9]),
        SamplingParams(temperature=1.0, logprobs=7, logprobs_mode="processed"),
    ]


def _assert_held_off_rows_are_batch_invariant(sampler, logits) -> None:
    """Each row alone equals its row in the batch, rows with min_tokens held off beside rows
    without (and the other way round)."""
    logits = logits.clone()
    logits[:, [EOS, 3, 4, 9]] += 4.0  # the held-off ids are likely picks: the masks matter
    params, seeds, positions = _held_off_params(), [11, 22, 33, 44, 55, 66], [0, 5, 1, 2, 0, 3]
    full = sampler.sample(logits, params, seeds, positions)
    for i in range(len(params)):
        alone = sampler.sample(logits[i : i + 1].clone(), [params[i]], [seeds[i]], [positions[i]])
        assert _same(alone[0], full[i]), i


def test_min_tokens_is_batch_invariant(logits):
    sampler = Sampler(lambda x: torch.log_softmax(x.float(), -1), cumsum_ref, eos_token_ids=(EOS,))
    _assert_held_off_rows_are_batch_invariant(sampler, logits)


def test_min_tokens_batch_invariance_negative_control(logits, monkeypatch):
    """A hold-off taken for the whole step (every row masks the ids any row holds off) gives a
    row without min_tokens other bits in the batch than alone: the comparison can fail."""
    sampler = Sampler(lambda x: torch.log_softmax(x.float(), -1), cumsum_ref, eos_token_ids=(EOS,))
    per_row = sampler._hold_off

    def step_wide(logits, params, positions):
        is_held = per_row(logits, params, positions).isinf().any(0)  # by any row
        return logits.masked_fill(is_held, float("-inf"))

    monkeypatch.setattr(sampler, "_hold_off", step_wide)
    with pytest.raises(AssertionError):
        _assert_held_off_rows_are_batch_invariant(sampler, logits)


def test_ids_past_the_tokenizer_are_never_sampled(logits):
    """sampled_vocab_size (the tokenizer's size): ids at or past it, the model's padding of its
    vocabulary, are -inf in what every row samples from, EOS excepted (a stop, with no text);
    raw logprobs stay the model's (decode equals score), processed ones are of the masked
    distribution. Each row alone equals its row in the batch."""
    num_ids, eos = 40, 45
    logits = logits.clone()
    logits[:, num_ids:] += 8.0  # the padding would win every draw
    sampler = Sampler(
        lambda x: torch.log_softmax(x.float(), -1), cumsum_ref, (eos,), sampled_vocab_size=num_ids
    )
    params = [
        SamplingParams(temperature=0.0, logprobs=3, ignore_eos=True),
        SamplingParams(temperature=1.0, logprobs=3, logprobs_mode="processed"),
        SamplingParams(temperature=0.7, top_k=5, logprobs=3),
        SamplingParams(temperature=1.0, top_p=0.5, logprobs=3, min_tokens=4),
        SamplingParams(temperature=2.0, logprobs=3, logprobs_mode="processed"),
        SamplingParams(temperature=0.0, logprobs=3, min_tokens=2),
    ]
    seeds, positions = [1, 2, 3, 4, 5, 6], [0, 1, 2, 0, 3, 1]
    full = sampler.sample(logits, params, seeds, positions)
    assert {r.token_id for r in full} <= {*range(num_ids), eos}
    assert full[0].token_id == eos  # greedy: EOS is the best id left (no stop: ignore_eos)
    assert full[5].token_id < num_ids  # EOS held off too before min_tokens
    raw = torch.log_softmax(logits, -1)
    assert full[0].logprob == raw[0, eos].item()
    assert any(t >= num_ids for t in full[0].top_logprobs)  # raw tops: the model's own
    masked = logits.masked_fill(torch.arange(50) >= num_ids, float("-inf"))
    masked[:, eos] = logits[:, eos]
    processed = torch.log_softmax(masked[1] / 1.0, -1)
    assert full[1].logprob == processed[full[1].token_id].item()
    assert all(t < num_ids or t == eos for t in full[1].top_logprobs)
    for i in range(len(params)):
        alone = sampler.sample(logits[i : i + 1].clone(), [params[i]], [seeds[i]], [positions[i]])
        assert _same(alone[0], full[i]), i
    draws = [sampler.sample(logits[1:2], [params[1]], [s], [0])[0].token_id for s in range(200)]
    assert max(draws) < num_ids or set(draws) - set(range(num_ids)) == {eos}
    unbounded = Sampler(lambda x: torch.log_softmax(x.float(), -1), cumsum_ref, (eos,))
    assert unbounded.sample(logits[:1], params[:1], [1], [0])[0].token_id >= num_ids  # control


@pytest.mark.parametrize("bad", [math.nan, math.inf])
@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, seed=3),
        SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=3, logprobs_mode="processed"),
    ],
    ids=["greedy", "sampled", "processed_top_k_top_p"],
)
def test_one_non_finite_logit_makes_the_chosen_logprob_nan(logits, bad, params):
    """What the engine ends a sample by (scheduler.is_non_finite): one NaN or +inf logit in a
    row, anywhere, gives a NaN chosen logprob (greedy or drawn, raw or processed, filtered),
    with both ops of the kernel table's reference; the other rows keep their results."""
    from moe_kernels.softmax import log_softmax_ref
    from moe_runtime.engine.scheduler import is_non_finite

    poisoned = logits.clone()
    poisoned[2, 17] = bad
    for log_softmax in (
        lambda x: torch.log_softmax(x, -1),
        lambda x: log_softmax_ref(x, tile_rows=4),
    ):
        sampler = Sampler(log_softmax, cumsum_ref)
        args = ([params] * 6, [3] * 6, [0] * 6)
        clean, results = sampler.sample(logits, *args), sampler.sample(poisoned, *args)
        assert [is_non_finite(r) for r in results] == [False, False, True, False, False, False]
        assert all(
            _same(a, b) for i, (a, b) in enumerate(zip(clean, results, strict=True)) if i != 2
        )
