"""The fused race kernel (kernels/race_sampling.py) under the Triton interpreter on CPU: its draws follow
softmax(logits / T), greedy rows take torch's argmax, the seed alone decides the tokens, partial chunks work, and
its Exp(1) noise is exact to float32.

As test_triton_interpreter.py: Triton decides interpret-or-compile when a kernel is decorated, so every call runs in
one child process (this file run as a script, with TRITON_INTERPRET=1 set from its start) that prints one JSON
record; this process decorates the kernels too, on import, but never launches them. The interpreter runs each
program in Python (~40 ms each here), so the draws are few and the chunks small.
"""

from __future__ import annotations

import functools
import json
import os

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from interpreter_child import interpreter_results

from pagedllm.kernels.race_sampling import _exponential_in_log2_units

VOCAB = 37
BLOCK = 32  # two chunks per row (the second one partial), each read as four quarters of 8 columns
QUARTER = BLOCK // 4
# logits / T of every sampled row: the rows at temperature T hold T * BASE, so all draws follow softmax(BASE), which
# puts ~0.8 of the mass on five tokens (a spread of logits that makes a wrong temperature scale show, below) and the
# rest on the 32 others (BACKGROUND). 11 and 35 lose every race to 3 when they share its noise: 11 is the same lane of
# quarter 1 (a kernel that gave all quarters the first Philox word), 35 the same lane of chunk 1 (a counter that
# forgot the chunk). 36 is the last column, in the partial chunk. Multiples of 0.5, for the exact sum test.
BASE = {3: 4.0, 11: 3.5, 35: 3.5, 36: 3.0, 20: 2.0}
BACKGROUND = 0.0
TEMPERATURES = (0.5, 2.0)  # alternating rows of every call: each row must read its own temperature
CALLS, ROWS_PER_CALL = 4, 32  # each call with its own seed: 64 draws per temperature, 2 programs per draw
DRAWS = CALLS * ROWS_PER_CALL // len(TEMPERATURES)
# Each check below gives an exact two-sided p-value under the right kernel; all must exceed CHECK_ALPHA, so the right
# kernel passes with probability >= 1 - 1e-4 (Bonferroni over the 15 checks). Their power at 64 draws per
# temperature, simulated by test_the_checks_tell_wrong_kernels_apart: a kernel that ignores the temperature (also:
# adds the noise before the division), multiplies by it, adds log E instead of subtracting it, gives all quarters
# one Philox word, forgets the chunk in its counter, or reads row 0's temperature for every row fails with
# probability >= 0.99, as does one that makes any one token's probability 0.4 too high, or token 3's 0.3 too low (the
# others scaled to make up for it); one that drops log2(e) from its scale (sampling at T / ln 2) fails with ~0.88,
# one that applies it twice (T * ln 2) with ~0.79. The 128 draws are 256 programs: ~10 s of interpreter here.
NUM_CHECKS = 2 * (len(BASE) + 1) + 3  # per temperature: each token's count and the sum; the sum over both
CHECK_ALPHA = 1e-4 / NUM_CHECKS

# Greedy rows: (logits, temperature) with ties across chunks, inside a chunk, everywhere, nowhere finite, and in the
# partial chunk, mixed with sampled rows whose winner is certain. Columns run 0..36 in chunks of 16.
TIES_BLOCK = 16
SEED_ROWS, SEED_BLOCK = 8, 64  # one chunk per row: the seed is under test there, the chunks are elsewhere
NEG_INF = float("-inf")


def tie_rows() -> list[tuple[list[float], float]]:
    def row(values: dict[int, float], background: float = 0.0) -> list[float]:
        return [values.get(column, background) for column in range(VOCAB)]

    return [
        (row({5: 3.0, 30: 3.0}), 0.0),  # a tie across chunks: 5
        (row({17: 2.0, 18: 2.0, 33: 1.0}), 0.0),  # a tie inside chunk 1: 17
        (row({}), 0.0),  # all equal: 0
        (row({}, NEG_INF), 0.0),  # nothing finite: 0, as torch.argmax
        (row({36: 0.5}, -2.0), 0.0),  # the last column, alone in its chunk's quarter
        (row({36: 0.0}, NEG_INF), 1.0),  # a sampled row can only take the one finite token
        (row({20: 80.0}), 0.7),  # or a token far above the rest
        (row({0: 1.0, 9: 1.0, 24: 1.0}, -3.0), 0.0),
    ]


# The noise's 23-bit uniform index k: both ends, both sides of the series' edge (v = 1 - u < 2^-6 from k = 2^23 - 2^17
# on), and a spread of others
NOISE_INDICES = [0, 1, 1000, 2**22, 2**23 - 2**17 - 1, 2**23 - 2**17, 2**23 - 2**17 + 1, 2**23 - 5000, 2**23 - 2]
NOISE_INDICES += [2**23 - 1] + [(index * 2654435761) % 2**23 for index in range(54)]


@triton.jit
def _noise_probe(bits_ptr, out_ptr, SIZE: tl.constexpr):
    offsets = tl.arange(0, SIZE)
    bits = tl.load(bits_ptr + offsets).to(tl.uint32)
    tl.store(out_ptr + offsets, _exponential_in_log2_units(bits, False))


def softmax(logits: np.ndarray) -> np.ndarray:
    weights = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return weights / weights.sum(axis=-1, keepdims=True)


BASE_LOGITS = np.array([BASE.get(column, BACKGROUND) for column in range(VOCAB)])
# The draws are counted in categories: each token of BASE, then the background together
CATEGORY_VALUES = np.append(list(BASE.values()), BACKGROUND)  # logits / T of each category's tokens
SUM_UNIT = 0.5  # every value is a multiple of it, so a sum of n draws takes at most n * 8 + 1 values


def categories(distribution: np.ndarray) -> np.ndarray:
    """[..., VOCAB] probabilities or counts -> [..., len(BASE) + 1]: BASE's tokens, then the background's sum."""
    tokens = distribution[..., list(BASE)]
    return np.concatenate([tokens, distribution.sum(axis=-1, keepdims=True) - tokens.sum(axis=-1, keepdims=True)], -1)


TARGET = categories(softmax(BASE_LOGITS))  # what every sampled row draws from


def count_pvalues(counts: np.ndarray) -> np.ndarray:
    """Exact two-sided binomial p-value of each category's count among the draws ([..., categories])."""
    from scipy.stats import binom  # here, not at the top: the interpreter child would import it for nothing (1.3 s)

    draws = counts.sum(axis=-1, keepdims=True)
    below, above = binom.cdf(counts, draws, TARGET), binom.sf(counts - 1, draws, TARGET)
    return np.minimum(1.0, 2 * np.minimum(below, above))


@functools.cache
def sum_distribution(draws: int) -> tuple[np.ndarray, np.ndarray, int]:
    """(P(S <= s), P(S >= s), lowest s) over the lattice of S, the sum in SUM_UNITs of `draws` values drawn from
    TARGET: the exact distribution, by convolution."""
    units = np.rint(CATEGORY_VALUES / SUM_UNIT).astype(int)
    assert np.array_equal(units * SUM_UNIT, CATEGORY_VALUES)
    one = np.zeros(units.max() - units.min() + 1)
    np.add.at(one, units - units.min(), TARGET)
    total = np.ones(1)
    for _ in range(draws):
        total = np.convolve(total, one)
    return np.cumsum(total), np.cumsum(total[::-1])[::-1], units.min() * draws


def sum_pvalue(counts: np.ndarray) -> np.ndarray:
    """Exact two-sided p-value of the sum of logits / T over the draws: the statistic that carries all a sample says
    about the temperature (softmax(logits / T) is an exponential family in 1 / T), so the check that a wrong
    temperature scale fails first."""
    at_most, at_least, lowest = sum_distribution(int(counts.sum(axis=-1).flat[0]))
    index = np.rint(counts @ CATEGORY_VALUES / SUM_UNIT).astype(int) - lowest
    return np.minimum(1.0, 2 * np.minimum(at_most[index], at_least[index]))


def failed_checks(counts: dict[float, np.ndarray]) -> np.ndarray:
    """Whether any check fails, for counts[T] [..., categories] of the draws at each temperature."""
    failed = sum_pvalue(sum(counts.values())) < CHECK_ALPHA
    for per_temperature in counts.values():
        failed |= count_pvalues(per_temperature).min(axis=-1) < CHECK_ALPHA
        failed |= sum_pvalue(per_temperature) < CHECK_ALPHA
    return failed


@pytest.fixture(scope="module")
def results() -> dict:
    return interpreter_results(__file__)


def counts_at(results: dict, temperature: float) -> np.ndarray:
    tokens = np.array(results["draws"][str(temperature)])
    assert len(tokens) == DRAWS and ((tokens >= 0) & (tokens < VOCAB)).all(), tokens
    return categories(np.bincount(tokens, minlength=VOCAB))


@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_draws_follow_the_softmax_of_logits_over_temperature(results: dict, temperature: float) -> None:
    counts = counts_at(results, temperature)
    assert count_pvalues(counts).min() >= CHECK_ALPHA, (counts, DRAWS * TARGET)
    assert sum_pvalue(counts) >= CHECK_ALPHA, (counts, DRAWS * TARGET)


def test_both_temperatures_together_pin_the_temperature_scale(results: dict) -> None:
    """Every row samples softmax(BASE), so a scale that is wrong by the same factor at each temperature (a lost or
    doubled log2(e)) shows in all the draws at once."""
    counts = sum(counts_at(results, temperature) for temperature in TEMPERATURES)
    assert sum_pvalue(counts) >= CHECK_ALPHA, (counts, 2 * DRAWS * TARGET)


def race_distribution(rng: np.random.Generator, scores, noise_columns: np.ndarray | None = None) -> np.ndarray:
    """Categories of argmax(scores(log E)) over 100,000 races (ties to the lowest column, as the kernel's), where
    column c takes the noise of column noise_columns[c] (its own by default)."""
    log_noise = np.log(rng.exponential(size=(100_000, VOCAB)))
    if noise_columns is not None:
        log_noise = log_noise[:, noise_columns]
    winners = np.argmax(scores(log_noise), axis=1)
    return categories(np.bincount(winners, minlength=VOCAB) / len(winners))


def wrong_kernels(rng: np.random.Generator) -> dict[str, tuple[dict[float, np.ndarray], float]]:
    """name -> (the categories' distribution at each temperature, the least power the checks must have)."""
    columns = np.arange(VOCAB)
    scaled = lambda scale: {t: categories(softmax(BASE_LOGITS * scale(t))) for t in TEMPERATURES}  # noqa: E731
    same = lambda distribution: dict.fromkeys(TEMPERATURES, distribution)  # noqa: E731
    right_race = lambda log_e: BASE_LOGITS - log_e  # noqa: E731
    one_word = race_distribution(rng, right_race, noise_columns=columns // BLOCK * BLOCK + columns % QUARTER)
    no_chunk = race_distribution(rng, right_race, noise_columns=columns % BLOCK)
    top_token = lambda shift: TARGET + shift * (np.eye(len(TARGET))[0] - TARGET) / (1 - TARGET[0])  # noqa: E731
    return {
        "no temperature (or the noise added before the division)": (scaled(lambda t: t), 0.99),
        "logits * T": (scaled(lambda t: t * t), 0.99),
        "+ log E": (same(race_distribution(rng, lambda log_e: BASE_LOGITS + log_e)), 0.99),
        "one Philox word for all quarters": (same(one_word), 0.99),
        "a counter without the chunk": (same(no_chunk), 0.99),
        "row 0's temperature for every row": (scaled(lambda t: t / TEMPERATURES[0]), 0.99),
        "token 3's probability 0.4 higher (the others' scaled down)": (same(top_token(0.4)), 0.99),
        "token 3's probability 0.3 lower (the others' scaled up)": (same(top_token(-0.3)), 0.99),
        "no log2(e) in the scale: T / ln 2": (scaled(lambda t: np.log(2)), 0.85),
        "log2(e) twice: T * ln 2": (scaled(lambda t: 1 / np.log(2)), 0.7),
    }


def rejection_rate(distributions: dict[float, np.ndarray], rng: np.random.Generator, experiments: int) -> float:
    counts = {t: rng.multinomial(DRAWS, distributions[t], size=experiments) for t in TEMPERATURES}
    return float(failed_checks(counts).mean())


def test_the_checks_tell_wrong_kernels_apart() -> None:
    """The checks above on simulated draws: those of the right kernel pass, those of wrong kernels fail (power)."""
    rng = np.random.default_rng(0)
    assert rejection_rate(dict.fromkeys(TEMPERATURES, TARGET), rng, 20_000) < 1e-3, "the right kernel would fail"
    for name, (distributions, least_power) in wrong_kernels(rng).items():
        assert rejection_rate(distributions, rng, 2_000) >= least_power, name


def test_greedy_rows_take_the_first_argmax_and_sampled_rows_a_certain_winner(results: dict) -> None:
    rows = tie_rows()
    expected = torch.tensor([logits for logits, _ in rows]).argmax(dim=-1).tolist()
    assert expected[:5] == [5, 17, 0, 0, 36]  # torch's rule: the first maximum (and 0 when nothing is finite)
    assert results["ties"] == expected
    assert results["ties_bfloat16"] == expected


def test_the_seed_alone_decides_the_tokens(results: dict) -> None:
    seeds = results["seeds"]
    assert seeds["again"] == seeds["first"]
    assert seeds["int_seed"] == seeds["first"]  # an int seed is the same stream as a device tensor holding it
    assert seeds["other_seed"] != seeds["first"]
    # 8 independent uniform draws over 37 tokens take at most 3 values with probability 1.3e-5
    assert len(set(seeds["first"])) > 3, "rows of the same logits draw independently"


def test_one_row_and_vocabularies_that_are_no_multiple_of_the_block(results: dict) -> None:
    edge = results["edge"]
    assert edge["one_row_greedy"] == [edge["one_row_argmax"]]
    assert edge["default_block_greedy"] == edge["default_block_argmax"]  # vocab 5000: chunks of 4096 and 904
    assert edge["default_block_sampled"] == [4999]  # the last column, far above the rest
    assert edge["no_rows"] == []


def test_the_noise_is_exact_next_to_u_one(results: dict) -> None:
    """-log2(u) of the 23-bit uniform u = (k + 0.5) / 2^23, to float32 precision everywhere: also next to u = 1, where
    the likely winners' small E come from (there the GPU's fast log2 would lose digits; the kernel sums a series)."""
    indices = np.array(NOISE_INDICES, dtype=np.float64)
    expected = -np.log2((indices + 0.5) / 2**23)
    np.testing.assert_allclose(results["noise"], expected, rtol=3e-7)  # measured 1.1e-7; a wrong v^4 term: 9e-7


def noise(low_bits: int = 0x1A5) -> list[float]:
    """The kernel's noise for each of NOISE_INDICES (any low 9 bits: they are dropped)."""
    bits = torch.tensor([(index << 9) | low_bits for index in NOISE_INDICES], dtype=torch.int64)
    out = torch.empty(len(bits))
    _noise_probe[(1,)](bits, out, SIZE=len(bits))
    return out.tolist()


def draws(race_sample) -> dict[str, list[int]]:
    """Each call's rows alternate between the temperatures, row i at temperature T holding T * BASE."""
    temperatures = torch.tensor(TEMPERATURES).repeat(ROWS_PER_CALL // len(TEMPERATURES))
    logits = temperatures[:, None] * torch.tensor(BASE_LOGITS, dtype=torch.float32)
    calls = torch.stack([race_sample(logits, temperatures, seed, block_size=BLOCK) for seed in range(CALLS)])
    return {str(t): calls[:, index :: len(TEMPERATURES)].flatten().tolist() for index, t in enumerate(TEMPERATURES)}


def ties(race_sample, dtype: torch.dtype) -> list[int]:
    rows = tie_rows()
    logits = torch.tensor([logits for logits, _ in rows], dtype=dtype)
    temperatures = torch.tensor([temperature for _, temperature in rows])
    return race_sample(logits, temperatures, 7, block_size=TIES_BLOCK).tolist()


def seeds(race_sample) -> dict[str, list[int]]:
    logits, temperatures = torch.zeros(SEED_ROWS, VOCAB), torch.ones(SEED_ROWS)
    call = lambda seed: race_sample(logits, temperatures, seed, block_size=SEED_BLOCK).tolist()
    first = call(torch.tensor([11]))
    return {"first": first, "again": call(torch.tensor([11])), "int_seed": call(11), "other_seed": call(12)}


def edge_cases(race_sample) -> dict:
    generator = torch.Generator().manual_seed(0)
    one_row = torch.randn(1, VOCAB, generator=generator)
    wide = torch.randn(2, 5000, generator=generator)
    wide[1, -1] = 100.0
    return {
        "one_row_greedy": race_sample(one_row, torch.zeros(1), 3, block_size=TIES_BLOCK).tolist(),
        "one_row_argmax": int(one_row.argmax()),
        "default_block_greedy": race_sample(wide[:1], torch.zeros(1), 3).tolist(),
        "default_block_argmax": wide[:1].argmax(dim=-1).tolist(),
        "default_block_sampled": race_sample(wide[1:], torch.ones(1), 3).tolist(),
        "no_rows": race_sample(torch.zeros(0, VOCAB), torch.zeros(0), 3).tolist(),
    }


def main() -> None:
    """The child process: every call under the interpreter."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from pagedllm.kernels.race_sampling import race_sample

    record = {
        "draws": draws(race_sample),
        "ties": ties(race_sample, torch.float32),
        "ties_bfloat16": ties(race_sample, torch.bfloat16),
        "seeds": seeds(race_sample),
        "edge": edge_cases(race_sample),
        "noise": noise(),
    }
    print(json.dumps(record))


if __name__ == "__main__":
    main()
