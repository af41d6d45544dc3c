"""CPU linear layers at small M: every projection of the default model (SmolLM2-135M) through each candidate kernel,
float32 and bfloat16 activations, interleaved in rounds, medians; with each variant's error against float64.

Variants (each holds the same Q4_1-like weight, except int8_rows, which is there for speed alone):
- mm: `F.linear` on the dequantized weight in the activation dtype (aten::mm, what runs today);
- mkl_packed (float32): `torch.ops.mkl._mkl_linear`, the weight packed by MKL for the call's M;
- onednn_packed: `torch.ops.mkldnn._linear_pointwise`, the weight reordered by oneDNN once (no batch-size hint:
  one packing serves every M, as an engine's layer would hold it);
- int4_g32: `_weight_int4pack_mm_for_cpu`, 4-bit values with a scale and a zero per 32 (Q4_0, Q4_1, Q4_K); with
  float32 activations, on activations cast to bfloat16 and the output cast back (its float32 path is not
  vectorised: 15-50x slower at M = 1 and 32, 1 thread, so not timed here; same for int4_g32_x2 and int8_rows);
- int4_g32_x2: the same kernel over [x, x] and a weight of twice the columns, an 8-bit value split in two 4-bit
  halves (Q8_0 exactly; Q5_* likewise);
- int8_rows (bfloat16): `_weight_int8pack_mm`, int8 values with one scale per row (cannot hold Q8_0's scales);
- dequant_mm: the 4-bit values dequantized at every call, then mm;
- grouped_4bit / grouped_8bit: pagedllm's own kernel (layers/quantization/cpu_grouped_gemm.cpp, what the engine runs
  since session 24) on the Q4_1-like weight and on the 8-bit one (Q8_0 exactly), activations rounded to int16 per 32.
Error: max |out - ref| / max |ref|, ref = float64 product of the activations and the weight the variant holds.

    python benchmarks/cpu_linear.py [--threads 2] [--rounds 5] [--rows 1 8 32 256] [--dtypes float32 bfloat16]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pagedllm.layers.quantization.gguf import IntGroups, pack  # noqa: E402

# (name, N, K) of SmolLM2-135M: hidden 576, intermediate 1536, 9 q heads / 3 kv heads x 64, vocabulary 49152
SHAPES = [
    ("qkv", (9 + 2 * 3) * 64, 576),
    ("o", 576, 576),
    ("gate_up", 2 * 1536, 576),
    ("down", 576, 1536),
    ("lm_head", 49152, 576),
]
GROUP = 32
MIN_SECONDS = 0.02  # per timing: as many calls as fit, at least 3


def load() -> str:
    with open("/proc/loadavg") as file:
        return file.read().split()[0]


def int4_pack(values: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, dtype: torch.dtype):
    """values [N, K] in 0..15, scales/zeros [N, K / 32]: weight = (values - 8) * scale + zero."""
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(values.to(torch.int32), 1)
    scales_and_zeros = torch.stack([scales.t(), zeros.t()], dim=-1).to(dtype).contiguous()
    return packed, scales_and_zeros


def int4_weight(values: torch.Tensor, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """The float64 weight an int4 pack stands for (with its scales as the kernel reads them)."""
    scales = scales_and_zeros[..., 0].double().t().repeat_interleave(GROUP, 1)
    zeros = scales_and_zeros[..., 1].double().t().repeat_interleave(GROUP, 1)
    return (values.double() - 8) * scales + zeros


class Weights:
    """One projection's weight in every variant's form, for one activation dtype."""

    def __init__(self, n: int, k: int, dtype: torch.dtype):
        torch.manual_seed(n * k)
        self.n, self.k, self.dtype = n, k, dtype
        # A Q4_1-like weight: 4-bit values, per-32 scale d and minimum m (weight = d q + m = (q - 8) d + (m + 8 d))
        self.values = torch.randint(0, 16, (n, k), dtype=torch.uint8)
        d = (torch.rand(n, k // GROUP) * 0.02 + 0.001).half().float()
        low = (-8 * d + torch.randn(n, k // GROUP) * 0.002).half().float()
        self.packed, self.scales_and_zeros = int4_pack(self.values, d, low + 8 * d, dtype)
        self.weight = int4_weight(self.values, self.scales_and_zeros).to(dtype)
        self.scales = self.scales_and_zeros[..., 0].t().contiguous()
        self.zeros = self.scales_and_zeros[..., 1].t().contiguous()
        # 8-bit values q in -128..127 as high and low 4-bit halves: q = 16 (high - 8) + (low - 8) + 8
        q8 = torch.randint(-128, 128, (n, k), dtype=torch.int8)
        d8 = (torch.rand(n, k // GROUP) * 0.002).half().float()
        self.halves = torch.cat([(q8.short() >> 4) + 8, q8.short() & 15], 1).to(torch.uint8)
        self.packed2, self.sz2 = int4_pack(
            self.halves, torch.cat([16 * d8, d8], 1), torch.cat([0 * d8, 8 * d8], 1), dtype
        )
        self.q_rows = q8
        self.grouped4 = IntGroups(self.values, d, low, 4)
        self.grouped8 = IntGroups(q8, d8, torch.zeros_like(d8), 8)
        self.packed4, self.packed8 = pack(self.grouped4), pack(self.grouped8)
        self.row_scales = (torch.rand(n) * 0.002).to(dtype)
        self.reordered: dict[int | str, torch.Tensor] = {}

    def for_rows(self, m: int) -> tuple:
        """The float weight packed by MKL for M = m (float32 only), and reordered by oneDNN once for every M."""
        if "onednn" not in self.reordered:
            self.reordered["onednn"] = torch.ops.mkldnn._reorder_linear_weight(self.weight)
        if m not in self.reordered and self.dtype == torch.float32:
            self.reordered[m] = torch.ops.mkl._mkl_reorder_linear_weight(self.weight, m)
        return self.reordered.get(m), self.reordered["onednn"]

    def variants(self, x: torch.Tensor) -> dict[str, Callable[[], torch.Tensor]]:
        m, n, k, w = x.shape[0], self.n, self.k, self
        mkl, onednn = self.for_rows(m)
        calls = {"mm": lambda: F.linear(x, w.weight)}
        if mkl is not None:
            calls["mkl_packed"] = lambda: torch.ops.mkl._mkl_linear(x, mkl, w.weight, None, m)
        calls["onednn_packed"] = lambda: torch.ops.mkldnn._linear_pointwise(x, onednn, None, "none", [], "")
        kernel = torch.ops.aten._weight_int4pack_mm_for_cpu
        if x.dtype == torch.float32:  # through bfloat16, the kernel's vectorised path
            sz, sz2 = w.scales_and_zeros.bfloat16(), w.sz2.bfloat16()
            calls["int4_g32"] = lambda: kernel(x.bfloat16(), w.packed, GROUP, sz).float()
            calls["int4_g32_x2"] = lambda: kernel(torch.cat([x, x], 1).bfloat16(), w.packed2, GROUP, sz2).float()
        else:
            calls["int4_g32"] = lambda: kernel(x, w.packed, GROUP, w.scales_and_zeros)
            calls["int4_g32_x2"] = lambda: kernel(torch.cat([x, x], 1), w.packed2, GROUP, w.sz2)
            calls["int8_rows"] = lambda: torch.ops.aten._weight_int8pack_mm(x, w.q_rows, w.row_scales)

        def dequant_mm() -> torch.Tensor:
            grouped = (w.values.view(n, k // GROUP, GROUP).to(x.dtype) - 8) * w.scales[..., None] + w.zeros[..., None]
            return F.linear(x, grouped.view(n, k))

        calls["dequant_mm"] = dequant_mm
        calls["grouped_4bit"] = lambda: w.packed4.multiply(x).to(x.dtype)
        calls["grouped_8bit"] = lambda: w.packed8.multiply(x).to(x.dtype)
        return calls

    def references(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each variant's float64 product with the weight it holds."""
        x64 = x.double()
        float_ref = x64 @ self.weight.double().t()
        int4_ref = x64 @ int4_weight(self.values, self.scales_and_zeros).t()
        halves = int4_weight(self.halves, self.sz2)
        int8_ref = x64 @ (halves[:, : self.k] + halves[:, self.k :]).t()
        rows_ref = x64 @ (self.q_rows.double() * self.row_scales.double()[:, None]).t()
        return {
            "mm": float_ref, "mkl_packed": float_ref, "onednn_packed": float_ref, "int4_g32": int4_ref,
            "int4_g32_x2": int8_ref, "int8_rows": rows_ref, "dequant_mm": int4_ref,
            "grouped_4bit": x64 @ self.grouped4.dequantize().double().t(),
            "grouped_8bit": x64 @ self.grouped8.dequantize().double().t(),
        }  # fmt: skip


def time_call(call: Callable[[], torch.Tensor]) -> float:
    """Median microseconds per call over calls filling MIN_SECONDS (at least 3)."""
    call()
    times = []
    started = time.perf_counter()
    while len(times) < 3 or time.perf_counter() - started < MIN_SECONDS:
        begin = time.perf_counter()
        call()
        times.append(time.perf_counter() - begin)
    return statistics.median(times) * 1e6


def error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).abs().max() / ref.abs().max()).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 256])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cells = [(shape, m, getattr(torch, dtype)) for dtype in args.dtypes for shape in SHAPES for m in args.rows]
    weights = {(shape, dtype): Weights(shape[1], shape[2], dtype) for shape, _, dtype in cells}
    inputs = {cell: torch.randn(cell[1], cell[0][2], dtype=cell[2]) for cell in cells}
    built = {cell: weights[(cell[0], cell[2])].variants(inputs[cell]) for cell in cells}
    names = list(dict.fromkeys(name for cell in cells for name in built[cell]))
    times: dict[tuple, list[float]] = {}
    loads = []
    for _ in range(args.rounds):
        loads.append(load())
        for cell in cells:
            for name, call in built[cell].items():  # variants interleaved within each cell, every round
                times.setdefault((cell, name), []).append(time_call(call))
    loads.append(load())
    print(f"\n{args.threads} threads, {args.rounds} rounds, medians in us; 1-minute load before each round and after: "
          f"{' '.join(loads)}")  # fmt: skip
    print("| shape (N x K) | M | dtype | " + " | ".join(names) + " | best |")
    print("|---|---|---|" + "---|" * (len(names) + 1))
    for cell in cells:
        (label, n, k), m, dtype = cell
        medians = {name: statistics.median(times[(cell, name)]) for name in built[cell]}
        row = [f"{medians[name]:.0f}" if name in medians else "-" for name in names]
        best = min(medians, key=medians.get)
        print(f"| {label} {n}x{k} | {m} | {str(dtype)[6:]} | " + " | ".join(row) + f" | {best} |")
    print("\nworst max relative error against float64 over every shape (at M = 8 rows):")
    print("| dtype | " + " | ".join(names) + " |\n|---|" + "---|" * len(names))
    for dtype in args.dtypes:
        worst: dict[str, float] = {}
        for shape in SHAPES:
            w = weights[(shape, getattr(torch, dtype))]
            x = torch.randn(8, shape[2], dtype=w.dtype)
            refs = w.references(x)
            for name, call in w.variants(x).items():
                worst[name] = max(worst.get(name, 0.0), error(call(), refs[name]))
        print(f"| {dtype} | " + " | ".join(f"{worst[name]:.1e}" if name in worst else "-" for name in names) + " |")


if __name__ == "__main__":
    main()
