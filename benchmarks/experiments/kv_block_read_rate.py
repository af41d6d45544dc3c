"""What this machine's memory gives a decode step's attention: the rate at which threads read a KV cache's worth of
float32 blocks listed in a table (a sequence's blocks lie anywhere in the cache), in order or shuffled, for several
block sizes; then the same read with `work` fused multiply-adds on each vector loaded, from memory and from a
cache-resident copy, to show how much of the arithmetic hides under the reads.

    python benchmarks/experiments/kv_block_read_rate.py [--threads 2] [--gb 1.2]

The default size is nano-vllm's shape at its decode steps on the default model: 39 rows of ~700 keys x 30 layers,
K and V (3 KV heads x 64 dims, 16 tokens a block: 12 KiB). The attention kernel (attention/cpu_paged_attention.cpp)
reads 3 query heads' worth of work per vector loaded (3 FMAs for the scores, 3 for the values).
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.utils.cpp_extension import load_inline

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

// Sums every float of the blocks table[0 ..] (block_floats floats each), the table split over the threads; each
// vector loaded also feeds `work` fused multiply-adds over 8 independent chains. Returns the sum (kept live).
double read_blocks(torch::Tensor cache, torch::Tensor table, int64_t block_floats, int64_t work) {
  const float* base = cache.data_ptr<float>();
  const int32_t* blocks = table.data_ptr<int32_t>();
  std::vector<double> partial(at::get_num_threads(), 0.0);
  at::parallel_for(0, table.numel(), 1, [&](int64_t first, int64_t last) {
    __m256 chains[8];
    for (auto& chain : chains) chain = _mm256_setzero_ps();
    const __m256 factor = _mm256_set1_ps(0.999f);
    for (int64_t b = first; b < last; ++b) {
      const float* block = base + static_cast<int64_t>(blocks[b]) * block_floats;
      for (int64_t i = 0; i < block_floats; i += 8) {
        const __m256 value = _mm256_loadu_ps(block + i);
        chains[i / 8 % 8] = _mm256_add_ps(chains[i / 8 % 8], value);
        for (int64_t w = 0; w < work; ++w) chains[w % 8] = _mm256_fmadd_ps(value, factor, chains[w % 8]);
      }
    }
    __m256 total = chains[0];
    for (int j = 1; j < 8; ++j) total = _mm256_add_ps(total, chains[j]);
    float lanes[8];
    _mm256_storeu_ps(lanes, total);
    partial[at::get_thread_num()] += lanes[0];
  });
  double sum = 0;
  for (double value : partial) sum += value;
  return sum;
}
"""


def timed_read(ops, cache: torch.Tensor, table: torch.Tensor, work: int) -> float:
    ops.read_blocks(cache, table, cache.shape[1], work)  # first touch and warm-up
    started = time.perf_counter()
    ops.read_blocks(cache, table, cache.shape[1], work)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--gb", type=float, default=30 * 39 * 44 * 2 * 12288 / 1e9)
    args = parser.parse_args()
    ops = load_inline("kv_block_read_rate", cpp_sources=[SOURCE], functions=["read_blocks"],
                      extra_cflags=["-O3", "-mavx2", "-mfma"])  # fmt: skip
    torch.set_num_threads(args.threads)
    slot_floats = 3 * 64  # 3 KV heads x 64 dims
    print(f"{args.threads} threads, {args.gb:.2f} GB read each time\n")
    print("| block (tokens, KiB) | in order GB/s | shuffled GB/s |\n| --- | --- | --- |")
    for tokens in (16, 32, 64, 128, 256):
        block_floats = tokens * slot_floats
        cache = torch.randn(int(args.gb * 1e9 / 4 / block_floats), block_floats)
        rates = [cache.numel() * 4 / timed_read(ops, cache, order.int(), 0) / 1e9
                 for order in (torch.arange(len(cache)), torch.randperm(len(cache)))]  # fmt: skip
        print(f"| {tokens}, {block_floats * 4 // 1024} | {rates[0]:.1f} | {rates[1]:.1f} |")
        del cache
    block_floats = 16 * slot_floats
    cache = torch.randn(int(args.gb * 1e9 / 4 / block_floats), block_floats)
    resident = torch.randn(64, block_floats)  # 768 KiB: L2 and L3
    shuffled = torch.randperm(len(cache)).int()
    revisits = torch.randint(0, 64, (len(cache),)).int()
    print("\n| FMAs a vector (16-token blocks, shuffled) | from memory ms | from cache ms | memory / cache |")
    print("| --- | --- | --- | --- |")
    for work in (0, 3, 6, 12, 24):
        from_memory, from_cache = timed_read(ops, cache, shuffled, work), timed_read(ops, resident, revisits, work)
        print(f"| {work} | {from_memory * 1e3:.0f} | {from_cache * 1e3:.0f} | {from_memory / from_cache:.2f} |")


if __name__ == "__main__":
    main()
