"""The n-gram proposer (prompt lookup): the tokens that followed the last earlier occurrence of the sequence's last
n tokens, for the longest n from prompt_lookup_max down to prompt_lookup_min that occurs."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n

    def propose(self, token_ids: list[int], num_tokens: int) -> list[int]:
        """Up to num_tokens tokens to follow token_ids (prompt and output); [] when no suffix of min_n tokens or more
        occurred before. The match is the latest one that some token follows; its continuation may run into the
        suffix itself (a repeating pattern goes on repeating)."""
        tokens = np.asarray(token_ids, dtype=np.int64)
        length = len(tokens)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            # Windows of n tokens that start before the suffix and have a token after them: starts 0 .. length-n-1.
            windows = sliding_window_view(tokens[: length - 1], n)
            matches = np.flatnonzero((windows == tokens[length - n :]).all(axis=1))
            if len(matches):
                start = int(matches[-1]) + n
                return tokens[start : start + num_tokens].tolist()
        return []
