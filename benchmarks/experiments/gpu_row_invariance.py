"""Does a row's attention output on the GPU keep its bits whatever else the step holds? The Triton kernels in
bfloat16 (and float32), one target row (one sequence's newest token) computed:
  alone       decode kernel, the sequence alone
  batch64     decode kernel beside 63 other sequences of other lengths (default_num_splits changes with the batch)
  verify4     prefill kernel, the last row of a 4-token query (a verify step is prompt-shaped on the GPU)
  splits=k    decode kernel alone with k splits
The torch backend on CPU attends such rows one at a time so that they are equal (attention/torch_backend.py); this
asks the same of the GPU path before greedy speculation in bfloat16 can be claimed exact there.

    python benchmarks/experiments/gpu_row_invariance.py [--contexts 300 3000]
"""

from __future__ import annotations

import argparse

import torch

from pagedllm.kernels import decode_attention, prefill_attention

HEADS, KV_HEADS, DIM, BLOCK = 16, 8, 128, 16


def case(dtype: torch.dtype, context: int, generator: torch.Generator) -> dict[str, float]:
    device = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: under TRITON_INTERPRET=1, to check the script
    lengths = [context] + [int(n) for n in torch.randint(1, 4 * context, (63,), generator=generator)]
    blocks_each = -(-max(lengths) // BLOCK)
    num_blocks = len(lengths) * blocks_each
    shape = (num_blocks, BLOCK, KV_HEADS, DIM)
    k_cache = torch.randn(shape, generator=generator).to(dtype).to(device)
    v_cache = torch.randn(shape, generator=generator).to(dtype).to(device)
    tables = torch.randperm(num_blocks, generator=generator).view(len(lengths), -1).int().to(device)
    queries = torch.randn(len(lengths), 4, HEADS, DIM, generator=generator).to(dtype).to(device)
    scale = DIM**-0.5
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device=device)

    def decode(count: int, **kwargs) -> torch.Tensor:
        query = queries[:count, -1].contiguous()
        return decode_attention(query, k_cache, v_cache, seq_lens[:count], tables[:count], scale, **kwargs)[0]

    alone = decode(1)
    rows = {"batch64": decode(64)}
    for splits in (1, 2, 8, 32):
        rows[f"splits={splits}"] = decode(1, num_splits=splits)
    query_start = torch.tensor([0, 4], dtype=torch.int32, device=device)
    verify = prefill_attention(queries[0].contiguous(), k_cache, v_cache, query_start, seq_lens[:1], tables[:1], scale)
    rows["verify4"] = verify[-1]
    return {name: (row.float() - alone.float()).abs().max().item() for name, row in rows.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--contexts", type=int, nargs="+", default=[300, 3000])
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(0)
    print("| dtype | context | " + " | ".join(["batch64", "splits=1", "splits=2", "splits=8", "splits=32", "verify4"])
          + " |")  # fmt: skip
    print("|---" * 8 + "|")
    for dtype in (torch.bfloat16, torch.float32):
        for context in args.contexts:
            diffs = case(dtype, context, generator)
            cells = " | ".join("equal" if d == 0 else f"{d:.1e}" for d in diffs.values())
            print(f"| {str(dtype).split('.')[1]} | {context} | {cells} |")


if __name__ == "__main__":
    main()
