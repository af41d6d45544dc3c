"""The fused race kernel (kernels/race_sampling.py) under the Triton interpreter on CPU: its draws follow
softmax(logits / T), greedy rows take torch's argmax, the seed alone decides the tokens, partial chunks work, and
its Exp(1) noise is exact to float32.

As test_triton_interpreter.py: Triton decides interpret-or-compile when a kernel is decorated, so every call runs in
one child process (this file run as a script, with TRITON_INTERPRET=1 set from its start) that prints one JSON
record; this process decorates the kernels too, on import, but never launches them. The interpreter runs each
program in Python (~10 ms each), so the draws are few and the chunks small.
"""

from __future__ import annotations

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
# Six tokens carry the mass, spread over both chunks of BLOCK = 32 columns (quarters of 8): 3 and 35 are the same
# lane of the same quarter in chunks 0 and 1, so a counter that forgot the chunk would give them the same noise; 36
# is the last column of the partial chunk. The 31 others share what is left.
HEAVY = {3: 2.0, 12: 0.8, 20: 1.2, 31: 0.4, 35: 1.6, 36: 1.0}
LOGITS = [HEAVY.get(column, -1.0) for column in range(VOCAB)]
BLOCK = 32
TEMPERATURES = (0.5, 2.0)
CALLS, ROWS_PER_CALL = 12, 20  # per temperature: 240 draws, each call with its own seed
DRAWS = CALLS * ROWS_PER_CALL
# Total variation over the six heavy tokens and "any other". At 240 draws its sampling error is ~0.04 on average
# and 0.14 at the 99.99% quantile (simulated), so a right kernel passes 0.16. The wrong kernels lie far beyond it:
# no temperature, or the noise added before the division ((logits - log E) / T has the argmax of logits - log E),
# both sample softmax(logits), at distance 0.36 (T = 0.5) and 0.29 (T = 2); logits * T instead of / T: 0.61;
# + log E instead of - log E: 0.46 at T = 2 (simulated); test_the_bound_tells_a_wrong_temperature_apart checks the
# first two.
TV_BOUND = 0.16
SAMPLING_ERROR = 0.14

# Greedy rows: (logits, temperature) with ties across chunks, inside a chunk, everywhere, nowhere finite, and in the
# partial chunk, mixed with sampled rows whose winner is certain. Columns run 0..36 in chunks of 16.
TIES_BLOCK = 16
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
    weights = np.exp(logits - logits.max())
    return weights / weights.sum()


def heavy_and_rest(distribution: np.ndarray) -> np.ndarray:
    heavy = distribution[list(HEAVY)]
    return np.append(heavy, 1.0 - heavy.sum())


def total_variation(p: np.ndarray, q: np.ndarray) -> float:
    return 0.5 * float(np.abs(heavy_and_rest(p) - heavy_and_rest(q)).sum())


@pytest.fixture(scope="module")
def results() -> dict:
    return interpreter_results(__file__)


@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_draws_follow_the_softmax_of_logits_over_temperature(results: dict, temperature: float) -> None:
    tokens = results["draws"][str(temperature)]
    assert len(tokens) == DRAWS
    frequencies = np.bincount(tokens, minlength=VOCAB) / DRAWS
    target = softmax(np.array(LOGITS) / temperature)
    assert total_variation(frequencies, target) < TV_BOUND, (heavy_and_rest(frequencies), heavy_and_rest(target))


def test_the_bound_tells_a_wrong_temperature_apart() -> None:
    """A wrong kernel's frequencies lie within SAMPLING_ERROR of its own distribution, so beyond TV_BOUND of the
    right one when the two distributions are more than TV_BOUND + SAMPLING_ERROR apart (at one temperature)."""
    logits = np.array(LOGITS)
    right = {t: softmax(logits / t) for t in TEMPERATURES}
    no_temperature = softmax(logits)  # also (logits - log E) / T: the same argmax as logits - log E
    assert max(total_variation(no_temperature, right[t]) for t in TEMPERATURES) > TV_BOUND + SAMPLING_ERROR
    assert max(total_variation(softmax(logits * t), right[t]) for t in TEMPERATURES) > TV_BOUND + SAMPLING_ERROR


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
    assert len(set(seeds["first"])) > 4, "rows of the same logits draw independently"


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
    tokens = {}
    for temperature in TEMPERATURES:
        logits = torch.tensor(LOGITS).repeat(ROWS_PER_CALL, 1)
        temperatures = torch.full((ROWS_PER_CALL,), temperature)
        calls = [race_sample(logits, temperatures, seed, block_size=BLOCK) for seed in range(CALLS)]
        tokens[str(temperature)] = torch.cat(calls).tolist()
    return tokens


def ties(race_sample, dtype: torch.dtype) -> list[int]:
    rows = tie_rows()
    logits = torch.tensor([logits for logits, _ in rows], dtype=dtype)
    temperatures = torch.tensor([temperature for _, temperature in rows])
    return race_sample(logits, temperatures, 7, block_size=TIES_BLOCK).tolist()


def seeds(race_sample) -> dict[str, list[int]]:
    logits, temperatures = torch.zeros(16, VOCAB), torch.ones(16)
    call = lambda seed: race_sample(logits, temperatures, seed, block_size=TIES_BLOCK).tolist()
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
