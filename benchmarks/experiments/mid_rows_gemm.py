"""Decode steps of 32-256 rows on the GPU: cuBLAS (F.linear) against a plain tiled Triton GEMM, several tile shapes
and K splits, on every projection of a model shape. On the H100 (session 33, TinyLlama-1.1B at batch 256) cuBLAS
took 11.2 us for qkv (10.5 MB of weights: 3.5 us of bytes at 3 TB/s) and the same for o (8.4 MB): 25-30% of the
copy rate, with 160 tiles of 64 x 64 in two waves over 132 multiprocessors.

Each candidate runs one layer's projection for every layer of the shape (each layer its own weights, so they come
from memory, as in a step), captured in one CUDA graph; the time is the median replay over the layers' count.

    python benchmarks/experiments/mid_rows_gemm.py [--shapes tinyllama-1.1b qwen3-0.6b] [--rows 64 128 256]

Prints, per shape, projection and row count: cuBLAS's time, the best Triton candidate's and its tiles, the
weights' bytes over the measured copy rate, and the candidates' error against a float32 product (bf16 rounding).
"""

from __future__ import annotations

import argparse
import statistics

import torch
import triton
import triton.language as tl

# (hidden, intermediate, q heads, kv heads, head_dim, layers)
SHAPES = {
    "qwen3-0.6b": (1024, 3072, 16, 8, 128, 28),
    "tinyllama-1.1b": (2048, 5632, 32, 4, 64, 22),
    "llama3.2-1b": (2048, 8192, 32, 8, 64, 16),
}
# (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, warps, stages)
CANDIDATES = [
    (64, 64, 64, 1, 4, 4),
    (64, 128, 64, 1, 4, 4),
    (128, 64, 64, 1, 4, 4),
    (128, 128, 64, 1, 8, 3),
    (64, 64, 128, 1, 4, 3),
    (64, 64, 64, 2, 4, 4),
    (64, 128, 64, 2, 4, 4),
    (128, 64, 64, 2, 4, 4),
    (128, 128, 64, 2, 8, 3),
    (64, 64, 64, 4, 4, 4),
    (128, 64, 64, 4, 4, 4),
    (128, 128, 64, 4, 8, 3),
]


@triton.jit
def _gemm_kernel(
    x_ptr, w_ptr, out_ptr, M, N, K, K_PER_SPLIT,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
):  # fmt: skip
    """out[split] = x[:, split's K] @ w[:, split's K]^T; x [M, K], w [N, K] row-major; out [M, N] in x's dtype when
    SPLIT_K is 1, else float32 partials [SPLIT_K, M, N]."""
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pid_k * K_PER_SPLIT
    for k0 in range(k_start, k_start + K_PER_SPLIT, BLOCK_K):
        a = tl.load(x_ptr + rows[:, None] * K + (k0 + ks)[None, :], mask=rows[:, None] < M, other=0.0)
        b = tl.load(w_ptr + cols[:, None] * K + (k0 + ks)[None, :], mask=cols[:, None] < N, other=0.0)
        acc = tl.dot(a, tl.trans(b), acc)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    if SPLIT_K == 1:
        tl.store(out_ptr + rows[:, None] * N + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(out_ptr + pid_k * M * N + rows[:, None] * N + cols[None, :], acc, mask=mask)


def triton_linear(x: torch.Tensor, w: torch.Tensor, candidate: tuple) -> torch.Tensor:
    block_m, block_n, block_k, split_k, warps, stages = candidate
    (m, k), n = x.shape, w.shape[0]
    assert k % (block_k * split_k) == 0
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n), split_k)
    if split_k == 1:
        out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    else:
        out = torch.empty(split_k, m, n, device=x.device, dtype=torch.float32)
    _gemm_kernel[grid](
        x, w, out, m, n, k, k // split_k, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out if split_k == 1 else out.sum(0).to(x.dtype)


def projections(shape: str) -> dict[str, tuple[int, int]]:
    hidden, intermediate, heads, kv_heads, head_dim, _ = SHAPES[shape]
    return {
        "qkv": ((heads + 2 * kv_heads) * head_dim, hidden),
        "o": (hidden, heads * head_dim),
        "gate_up": (2 * intermediate, hidden),
        "down": (hidden, intermediate),
    }


def graph_time_us(run, layers: int) -> float:
    """Median replay of a graph holding `run(layer)` for every layer, per layer, in us."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for layer in range(layers):
            run(layer)  # warm-up: compiles, allocates
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for layer in range(layers):
            run(layer)
    times = []
    for _ in range(30):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / layers)
    return statistics.median(times)


def copy_rate() -> float:
    """Bytes a second of a 1 GiB device-to-device copy (read + written)."""
    a = torch.empty(1 << 29, dtype=torch.bfloat16, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        b.copy_(a)
    end.record()
    end.synchronize()
    return 10 * 2 * a.numel() * 2 / (start.elapsed_time(end) / 1000)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES))
    parser.add_argument("--rows", nargs="+", type=int, default=[32, 64, 128, 256])
    args = parser.parse_args()
    torch.manual_seed(0)
    rate = copy_rate()
    print(f"{torch.cuda.get_device_name()}: copy {rate / 1e12:.2f} TB/s")
    lines = ["| shape | proj | rows | cuBLAS us | best Triton us | tiles (BM, BN, BK, split, warps, stages) | "
             "Triton / cuBLAS | bytes us | worst rel. error |", "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for shape in args.shapes:
        layers = SHAPES[shape][-1]
        for name, (n, k) in projections(shape).items():
            weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(layers)]
            for m in args.rows:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                reference = x.float() @ weights[0].float().t()
                cublas = graph_time_us(lambda layer, x=x, w=weights: torch.nn.functional.linear(x, w[layer]), layers)
                best, worst_error = None, 0.0
                for candidate in CANDIDATES:
                    if k % (candidate[2] * candidate[3]):
                        continue
                    got = triton_linear(x, weights[0], candidate).float()
                    error = ((got - reference).norm() / reference.norm()).item()
                    worst_error = max(worst_error, error)
                    if not error < 1e-2:
                        print(f"WRONG {shape} {name} m={m} {candidate}: rel. error {error:.2e}")
                        continue

                    def run(layer, x=x, w=weights, c=candidate):
                        return triton_linear(x, w[layer], c)

                    took = graph_time_us(run, layers)
                    if best is None or took < best[0]:
                        best = (took, candidate)
                bytes_us = (n * k + m * k + m * n) * 2 / rate * 1e6
                lines.append(
                    f"| {shape} | {name} | {m} | {cublas:.1f} | {best[0]:.1f} | {best[1]} | {best[0] / cublas:.2f} | "
                    f"{bytes_us:.1f} | {worst_error:.1e} |"
                )
                print(lines[-1], flush=True)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
