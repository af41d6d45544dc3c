"""A cast that returns its input untouched, without a call into torch, when the dtype already matches.

x.to(x.dtype) returns x too, but through torch's dispatcher (~1 us on CPU); a CPU decode step of the default model
made ~370 such calls, most of them with nothing to do (float32 activations into float32 statistics and back).
"""

from __future__ import annotations

import torch


def cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x if x.dtype == dtype else x.to(dtype)
