"""Fuse the small element-wise ops on CUDA with torch.compile; on CPU they run as written (no compile time).

Each decorated function is a few element-wise ops that eager mode would launch as separate kernels; compiled,
they become one Triton kernel. Shapes are dynamic so a new batch size does not recompile.
"""

from __future__ import annotations

import functools
import os

import torch

ENABLED = os.environ.get("PAGEDLLM_COMPILE", "1") != "0"


def fuse_on_cuda(function):
    @functools.cache
    def compiled():  # built on first CUDA use: importing the compiler costs CPU-only runs seconds
        # Every engine in a process (tests build many, with other dtypes and shapes) adds a specialisation.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 256)
        # compile_threads 1: inductor compiles in this process and starts no pool of worker processes (a sidecar
        # importing torch, then one worker per core) that would still be starting when LLM() returns.
        return torch.compile(function, dynamic=True, fullgraph=True, options={"compile_threads": 1})

    @functools.wraps(function)
    def dispatch(x: torch.Tensor, *args):
        return compiled()(x, *args) if ENABLED and x.is_cuda else function(x, *args)

    return dispatch
