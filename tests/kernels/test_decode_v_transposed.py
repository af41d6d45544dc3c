"""The experimental decode kernel over a transposed V (and K) cache layout (benchmarks/experiments/
decode_v_transposed.py) against the torch reference, under the Triton interpreter on CPU.

As test_triton_interpreter.py: the checks run in one child process (this file run as a script, TRITON_INTERPRET=1
set before pagedllm.kernels is imported) that prints one JSON record. Each case builds a poisoned paged batch
(paged_batch.make_batch: NaN outside every sequence's context), stores the step's new K/V with the Triton store
kernel, transposes the cache blocks into the experiment's layout and attends.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
import torch
from paged_batch import Step, make_batch, reference_attention

ROOT = Path(__file__).resolve().parents[2]
# name -> (Step, the launcher's keyword arguments); decode steps, one new token per sequence.
CASES = {
    "fp8_head_dim128_group2_splits3": (Step((1,) * 5, (0, 70, 17, 33, 64), 4, 2, 128, kv_cache_dtype="fp8"),
                                       dict(num_splits=3, block_n=32)),
    "fp8_via_f16_head_dim80_group1_block32": (Step((1,) * 3, (40, 0, 23), 2, 2, 80, 32, kv_cache_dtype="fp8"),
                                              dict(num_splits=2, block_n=16, fp8_via_f16=True)),
    "fp8_head_dim80_group2_splits4": (Step((1,) * 2, (90, 33), 4, 2, 80, kv_cache_dtype="fp8"),
                                      dict(num_splits=4, block_n=16)),
    "fp8_k_transposed_too": (Step((1,) * 3, (64, 45, 3), 4, 2, 128, kv_cache_dtype="fp8"),
                             dict(num_splits=1, block_n=32, k_transposed=True)),
    "fp8_not_peeled": (Step((1,) * 2, (50, 19), 4, 2, 64, kv_cache_dtype="fp8"),
                       dict(num_splits=2, block_n=32, peel_last_tile=False)),
    "fp8_engine_layout_peeled": (Step((1,) * 2, (50, 32), 4, 2, 80, kv_cache_dtype="fp8"),
                                 dict(num_splits=2, block_n=32, v_transposed=False)),
    "float32_head_dim128_group2": (Step((1,) * 3, (33, 0, 100), 4, 2, 128), dict(num_splits=3, block_n=32)),
    "swap_ab_head_dim128_group2": (Step((1,) * 3, (70, 0, 64), 4, 2, 128, kv_cache_dtype="fp8"),
                                   dict(num_splits=2, block_n=32, fp8_via_f16=True, swap_ab=True)),
    "swap_ab_fp8_pv_head_dim80_group1": (Step((1,) * 2, (45, 96), 2, 2, 80, kv_cache_dtype="fp8"),
                                         dict(num_splits=3, block_n=16, fp8_via_f16=True, swap_ab=True, fp8_pv=True)),
    "fp8_pv_rows64": (Step((1,) * 2, (50, 33), 4, 2, 64, kv_cache_dtype="fp8"),
                      dict(num_splits=1, block_n=16, fp8_via_f16=True, fp8_pv=True, min_rows=64)),
}  # fmt: skip


def tolerance(kernel_args: dict) -> float:
    """float32 dots 1e-5; float16 dots (fp8_via_f16) 3e-3. Probabilities converted to e4m3 (fp8_pv): only a loose
    check, as the interpreter's float8 conversion drops the rounding carry (kv_store.round_to_fp8's docstring)."""
    return 0.1 if kernel_args.get("fp8_pv") else 3e-3 if kernel_args.get("fp8_via_f16") else 1e-5


@pytest.fixture(scope="module")
def results() -> dict:
    python_path = os.pathsep.join([str(ROOT), str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": python_path}
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", CASES)
def test_transposed_layout_matches_reference(results: dict, name: str) -> None:
    record = results[name]
    assert record["traceback"] is None, record["traceback"]
    assert record["all_written"], "some output element is NaN: a read outside the context, or an unwritten row"
    assert record["padding_rows_zero"], "a padding row (seq_len 0) must come out as zeros"
    assert record["rel_err"] < tolerance(CASES[name][1]), record


def check(step: Step, kernel_args: dict, generator: torch.Generator) -> dict:
    from benchmarks.experiments.decode_v_transposed import decode_attention_transposed, transpose_cache
    from pagedllm.kernels import store_kv_cache

    batch = make_batch(step, generator)
    scale = step.head_dim**-0.5
    reference, _ = reference_attention(batch, scale)
    md, scales = batch.metadata, dict(k_scale=batch.k_scale, v_scale=batch.v_scale)
    store_kv_cache(batch.key, batch.value, batch.k_cache, batch.v_cache, md.slot_mapping, **scales)
    k_cache = transpose_cache(batch.k_cache) if kernel_args.get("k_transposed") else batch.k_cache
    v_cache = transpose_cache(batch.v_cache) if kernel_args.get("v_transposed", True) else batch.v_cache
    out = torch.full_like(batch.query, float("nan"))
    decode_attention_transposed(batch.query, k_cache, v_cache, md.seq_lens, md.block_tables, scale, out=out,
                                **scales, **kernel_args)  # fmt: skip
    real = md.seq_lens > 0
    error = ((out[real].double() - reference[real]).norm() / reference[real].norm()).item()
    return {
        "all_written": not bool(out.isnan().any()),
        "padding_rows_zero": bool((out[~real] == 0).all()),
        "rel_err": error if error == error else float("inf"),
    }


def main() -> None:
    """The child process: every case under the interpreter."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    generator = torch.Generator().manual_seed(0)
    records = {}
    for name, (step, kernel_args) in CASES.items():
        try:
            records[name] = {**check(step, kernel_args, generator), "traceback": None}
        except Exception:
            records[name] = {"traceback": traceback.format_exc()}
    print(json.dumps(records))


if __name__ == "__main__":
    main()
