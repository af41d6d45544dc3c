"""The fused activation quantization (kernels/fp8_quant.py) against the torch reference (layers/quantization/fp8.py):
under the Triton interpreter on CPU (in a child process, as test_race_sampling.py explains), and compiled on a GPU.

The interpreter's float32 -> e4m3 cast does not carry a rounding into the next power of two (124.5 becomes 64, where
the GPU, like torch, gives 128), rounds exact ties away from zero (the GPU and torch round them to even) and
truncates subnormals, so on CPU values are compared only where the reference is a normal number, not a power of two,
and the input no tie; the scales, exact either way, everywhere. On the GPU everything is compared exactly.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from interpreter_child import interpreter_results

from pagedllm.layers.quantization.fp8 import quantize_groups, quantize_rows

# (rows, cols, group): a row shorter than the kernel's block, a row of several blocks with a ragged end, groups
CASES = [(3, 200, None), (4, 2500, None), (5, 384, 128), (2, 1024, 128)]


def compare(case: tuple[int, int, int | None], device: str, exact: bool) -> dict:
    from pagedllm.kernels.fp8_quant import quantize

    rows, cols, group = case
    generator = torch.Generator().manual_seed(rows * cols)
    x = (torch.randn(rows, cols, generator=generator) * 3).to(torch.bfloat16)
    x[0, : cols // 2] = 0  # a group of zeros gets the smallest scale, not a division by zero
    values, scales = quantize(x.to(device), group)
    expected_values, expected_scales = quantize_rows(x) if group is None else quantize_groups(x, group)
    values, expected = values.float().cpu(), expected_values.float()
    comparable = torch.ones_like(expected, dtype=torch.bool)
    if not exact:
        scaled = x.float() / (expected_scales if group is None else expected_scales.repeat_interleave(group, 1))
        nudged = [(scaled * factor).to(torch.float8_e4m3fn).float() for factor in (1 - 2**-20, 1 + 2**-20)]
        no_tie = (nudged[0] == expected) & (nudged[1] == expected)
        normal = expected.abs() >= torch.finfo(torch.float8_e4m3fn).smallest_normal
        comparable = no_tie & normal & (expected.abs().log2().frac() != 0)
    return {
        "scales_equal": torch.equal(scales.cpu(), expected_scales),
        "column_major": group is None or scales.stride(0) == 1,
        "values_equal": torch.equal(values[comparable], expected[comparable]),
        "compared": int(comparable.sum()),
    }


def test_fused_quantization_matches_torch_under_the_interpreter():
    results = interpreter_results(__file__)
    for case, result in zip(CASES, results["cases"]):
        assert result["scales_equal"] and result["column_major"], case
        assert result["values_equal"], case
        assert result["compared"] > 0.6 * case[0] * case[1], case  # most values compared


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES)
def test_fused_quantization_matches_torch_on_the_gpu(case):
    result = compare(case, "cuda", exact=True)
    assert result["scales_equal"] and result["column_major"] and result["values_equal"], result


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1"
    print(json.dumps({"cases": [compare(case, "cpu", exact=False) for case in CASES]}))
