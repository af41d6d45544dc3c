"""The default model's LM head (tied Q8_0, 49152 x 576) in the engine: kept as int4 halves against the same weight
dequantized to float32 through aten::mm and through oneDNN (reordered once), at M = 1 and 32, 3 rounds of 20 calls.

    python benchmarks/experiments/gguf_lm_head.py [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from pagedllm import LLM


def median_ms(call, calls: int = 20) -> float:
    call()
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    head = LLM(device="cpu", threads=args.threads).llm_engine.worker.model.lm_head
    assert head.quantized, "the default model's vocabulary should be kept quantized on CPU"
    dense = head.method.embed(torch.arange(head.vocab_size), torch.float32)
    reordered = torch.ops.mkldnn._reorder_linear_weight(dense)
    print("| M | kept (int4 halves) ms | float aten::mm ms | float oneDNN ms | load |\n|---|---|---|---|---|")
    for rows in (1, 32):
        hidden = torch.randn(rows, dense.shape[1])
        for _ in range(3):
            kept = median_ms(lambda hidden=hidden: head.compute_logits(hidden))
            mm = median_ms(lambda hidden=hidden: F.linear(hidden, dense))
            onednn = median_ms(
                lambda hidden=hidden: torch.ops.mkldnn._linear_pointwise(hidden, reordered, None, "none", [], "")
            )
            with open("/proc/loadavg") as file:
                load = file.read().split()[0]
            print(f"| {rows} | {kept:.1f} | {mm:.1f} | {onednn:.1f} | {load} |")


if __name__ == "__main__":
    main()
