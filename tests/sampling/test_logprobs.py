"""Logprob tensors become vLLM's per-position dicts: the chosen token always, then each row's own top-N."""

from __future__ import annotations

import torch

from pagedllm.outputs import Logprob
from pagedllm.sampling.logprobs import compute_logprobs, position_logprobs


def test_each_row_gets_its_own_top_n_and_the_chosen_token():
    raw = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.1, 0.2, 0.3, 0.4]]).log()
    tensors = compute_logprobs(raw, token_ids=torch.tensor([3, 3]), num_top=2)
    rows = position_logprobs(tensors, chosen_token_ids=[3, 3], num_logprobs=[2, 1], decode=lambda t: f"<{t}>")
    logprob = lambda row, token: raw[row, token].item()
    assert rows[0] == {
        3: Logprob(logprob(0, 3), 4, "<3>"),
        0: Logprob(logprob(0, 0), 1, "<0>"),
        1: Logprob(logprob(0, 1), 2, "<1>"),
    }
    assert list(rows[0]) == [3, 0, 1]  # the chosen token first, as vLLM
    assert rows[1] == {3: Logprob(logprob(1, 3), 1, "<3>")}  # chosen and top-1 at once: one entry
