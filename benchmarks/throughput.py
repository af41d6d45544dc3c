"""Offline throughput on nano-vllm's workload against the roofline (same as `pagedllm bench`).

Run on a GPU: python benchmarks/throughput.py --shape qwen3-0.6b --output result.json
"""

from pagedllm.entrypoints.bench import build_parser, run

if __name__ == "__main__":
    run(build_parser().parse_args())
