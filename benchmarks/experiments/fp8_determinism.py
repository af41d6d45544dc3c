"""Are fp8-weight steps deterministic? The same engine twice (eager, then graphs), and the same fp8 product at the
engine's prefill shapes repeated: bitwise equal or not. (`graphs, caching and chunking change nothing` failed with
fp8 weights on the H200 at c8baf8d: is the cuBLASLt fp8 GEMM itself run-to-run nondeterministic?)"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "gpu")]
from conftest import TINY_MODELS, write_tiny_model  # noqa: E402
from test_gpu_engine import SMALL, prompts, tokens  # noqa: E402

from pagedllm import LLM  # noqa: E402
from pagedllm.layers.quantization.fp8 import quantize_rows  # noqa: E402

TINY_MODELS["llama_h128"] = ("llama", dict(hidden_size=128, intermediate_size=256, num_key_value_heads=2, head_dim=32))
directory = tempfile.mkdtemp()
write_tiny_model(directory, "llama_h128")
batch = prompts()
for keywords in (dict(enforce_eager=True), dict(enforce_eager=True), dict(), dict()):
    llm = LLM(directory, dtype="bfloat16", quantization="fp8", **SMALL, **keywords)
    print(keywords, [output[:6] for output in tokens(llm, batch)][4:7], flush=True)
    llm.shutdown()
weight, scales = quantize_rows(torch.randn(256, 128, device="cuda"))
for rows in (16, 1024, 2048):
    x, x_scales = quantize_rows(torch.randn(rows, 128, device="cuda"))
    outs = [torch._scaled_mm(x, weight.t(), x_scales, scales.t(), out_dtype=torch.bfloat16) for _ in range(20)]
    print(f"rows {rows}: 20 products bitwise equal: {all(torch.equal(outs[0], out) for out in outs)}")
