"""The small element-wise functions, run as written or fused by torch.compile where the kernel choices compile
(CUDA by default; KernelChoices.compile): each is a few ops that eager mode launches as separate kernels; compiled,
they become one Triton kernel. Shapes are dynamic so a new batch size does not recompile.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch


def fusible(function: Callable) -> Callable:
    """Give `function` a `compiled` twin: the same computation through torch.compile, built on its first call
    (importing the compiler costs an eager run seconds). The function itself stays as written."""

    @functools.cache
    def build():
        # Every engine in a process (tests build many, with other dtypes and shapes) adds a specialisation.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 256)
        # compile_threads 1: inductor compiles in this process and starts no pool of worker processes (a sidecar
        # importing torch, then one worker per core) that would still be starting when LLM() returns.
        return torch.compile(function, dynamic=True, fullgraph=True, options={"compile_threads": 1})

    @functools.wraps(function)
    def compiled(*args):
        return build()(*args)

    function.compiled = compiled
    return function


def fused(function: Callable, compile: bool) -> Callable:
    """A fusible function's compiled twin when `compile`, else the function as written."""
    return function.compiled if compile else function
