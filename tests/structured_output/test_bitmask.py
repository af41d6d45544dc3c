"""apply_bitmask against the mask read bit by bit: exactly the allowed tokens keep their logits, in the named rows
only; tokens past the mask's words are disallowed, bits past the vocabulary ignored; no masked row changes nothing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm.structured_output.bitmask import apply_bitmask


def random_bitmask(rng: np.random.Generator, num_rows: int, num_words: int) -> np.ndarray:
    return rng.integers(-(2**31), 2**31, size=(num_rows, num_words), dtype=np.int64).astype(np.int32)


def allowed_by_bits(row: np.ndarray, vocab_size: int) -> np.ndarray:
    """[vocab_size] bool: bit t % 32 of word t // 32 set, and t inside the mask's words."""
    words = row.tolist()
    return np.array(
        [token < 32 * len(words) and bool(words[token // 32] >> (token % 32) & 1) for token in range(vocab_size)]
    )


@pytest.mark.parametrize(
    ("vocab_size", "num_words"),
    [(64, 2), (100, 4), (130, 4), (49152, 1536)],  # exact, bits past the vocabulary, tokens past the mask, a real size
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_exactly_the_allowed_tokens_keep_their_logits(vocab_size, num_words, dtype):
    rng = np.random.default_rng(vocab_size)
    logits = torch.randn(5, vocab_size).to(dtype)
    bitmask = random_bitmask(rng, 2, num_words)
    bitmask[1, 0] = -1  # every bit of a word, bit 31 (the sign) included
    rows = torch.tensor([3, 0])
    original = logits.clone()
    apply_bitmask(logits, torch.from_numpy(bitmask), rows)
    for index, row in enumerate(rows.tolist()):
        allowed = torch.from_numpy(allowed_by_bits(bitmask[index], vocab_size))
        assert torch.equal(logits[row][allowed], original[row][allowed])
        assert torch.isneginf(logits[row][~allowed]).all()
    for row in (1, 2, 4):
        assert torch.equal(logits[row], original[row])


def test_without_rows_bitmask_row_i_masks_logits_row_i():
    rng = np.random.default_rng(0)
    logits = torch.randn(3, 96)
    bitmask = random_bitmask(rng, 3, 3)
    expected = logits.clone()
    expected[~torch.from_numpy(np.stack([allowed_by_bits(row, 96) for row in bitmask]))] = float("-inf")
    apply_bitmask(logits, torch.from_numpy(bitmask))
    assert torch.equal(logits, expected)


def test_no_masked_row_leaves_the_logits_alone():
    logits = torch.randn(4, 64)
    original = logits.clone()
    apply_bitmask(logits, torch.zeros(0, 2, dtype=torch.int32), torch.zeros(0, dtype=torch.long))
    assert torch.equal(logits, original)
