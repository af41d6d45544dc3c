"""apply_bitmask: the constrained rows' disallowed tokens get -inf logits, on the logits' device, before sampling.

Bit t % 32 of int32 word t // 32 of a row allows token t. The bits are unpacked with shifts for every row at once;
no Python loop runs over tokens or rows.
"""

from __future__ import annotations

import torch


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None) -> None:
    """In place on logits [num_rows, vocab]. bitmask: int32 [num_masked, words] on the logits' device; row i masks
    logits row rows[i] (rows: distinct int64 indices on the device), or row i itself when rows is None. Tokens past
    32 * words (a vocabulary padded beyond the tokenizer's) are disallowed; bits past vocab are ignored. Rows not
    named are untouched; with no masked row nothing runs."""
    num_masked, vocab = bitmask.shape[0], logits.shape[-1]
    if num_masked == 0:
        return
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).view(num_masked, -1).bool()  # [num_masked, 32 * words]
    if allowed.shape[1] >= vocab:
        allowed = allowed[:, :vocab]
    else:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    if rows is None:
        logits.masked_fill_(~allowed, float("-inf"))
    else:
        logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
