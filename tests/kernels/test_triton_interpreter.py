"""The Triton kernels against the torch reference backend on CPU, under the Triton interpreter (TRITON_INTERPRET=1).

Triton decides interpret-or-compile when a kernel is decorated, so the cases run in one child process that sets the
variable before importing pagedllm.kernels; nothing leaks into other test modules. The child is this file run as a
script: it prints one JSON record of checks per case.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pytest
import torch


@dataclass(frozen=True)
class Case:
    query_lens: tuple[int, ...]  # new tokens per sequence this step
    seq_lens: tuple[int, ...]  # context after the step (cached + new); 0 = padding row (decode only)
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    block_size: int = 16
    dtype: str = "float32"
    skip_slots: tuple[int, ...] = ()  # token rows whose slot_mapping is -1 (their K/V are already cached)
    kernel_args: dict = field(default_factory=dict)  # tile sizes / num_splits passed to the launcher
    through_backend: bool = False  # call TritonAttentionBackend.forward instead of the kernels


PREFILL_TILES = {"block_m": 16, "block_n": 16}
CASES = {
    "fresh_prefill": Case((37, 5, 16, 1), (37, 5, 16, 1), kernel_args=PREFILL_TILES),
    "fresh_prefill_fp16_group1": Case((21, 40), (21, 40), 2, 2, dtype="float16", kernel_args=PREFILL_TILES),
    "prefix_hit": Case((9, 3, 17), (41, 35, 49), 8, 2, block_size=32, kernel_args=PREFILL_TILES),
    "chunked_prefill": Case((24, 24), (44, 24), 4, 1, kernel_args={"block_m": 32, "block_n": 32}),
    "mixed_batch_fp16": Case((1, 19, 1, 30), (50, 19, 7, 45), dtype="float16", kernel_args=PREFILL_TILES),
    "mixed_batch_group3": Case((1, 12, 26), (33, 12, 40), 6, 2, block_size=32, kernel_args=PREFILL_TILES),
    "mixed_batch_head_dim128": Case((2, 13), (20, 29), 4, 1, head_dim=128, kernel_args=PREFILL_TILES),
    "skipped_slots": Case((12, 9), (30, 9), skip_slots=(0, 5, 13), kernel_args=PREFILL_TILES),
    "prefill_backend_defaults": Case((70, 3), (70, 45), 8, 2, dtype="float16", through_backend=True),
    "decode_one_split": Case((1,) * 4, (37, 1, 64, 0), kernel_args={"num_splits": 1, "block_n": 16}),
    "decode_splits_group4": Case((1,) * 5, (0, 90, 17, 33, 0), 8, 2, kernel_args={"num_splits": 3, "block_n": 16}),
    "decode_fp16_block32": Case((1,) * 3, (70, 5, 40), 2, 1, 64, 32, "float16", kernel_args={"num_splits": 4}),
    "decode_backend_defaults": Case((1,) * 3, (129, 0, 64), 8, 4, dtype="float16", through_backend=True),
    "decode_skipped_slot": Case((1,) * 3, (20, 33, 0), skip_slots=(2,), kernel_args={"num_splits": 2}),
}
TOLERANCE = {"float32": 1e-5, "float16": 3e-3}


@pytest.fixture(scope="module")
def results() -> dict:
    root = str(Path(__file__).resolve().parents[2])
    python_path = os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": python_path}
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", CASES)
def test_kernels_match_torch_reference(results: dict, name: str) -> None:
    record = results[name]
    assert record["traceback"] is None, record["traceback"]
    assert record["cache_matches"], "store_kv_cache wrote a slot it should not have, or missed one"
    assert record["all_written"], "some output element is still NaN (unwritten, or read an unused cache slot)"
    assert record["padding_rows_zero"], "a padding row (seq_len 0) must come out as zeros"
    assert record["rel_err"] < TOLERANCE[CASES[name].dtype], record


# ---- child process: everything below runs under TRITON_INTERPRET=1 ----


def build_inputs(case: Case, generator: torch.Generator) -> dict:
    """Random paged layout: cache poisoned with NaN except the cached context; block 0 is an all-NaN block that
    every unused block-table entry points to, so a kernel that reads past a sequence's end produces NaN."""
    dtype = getattr(torch, case.dtype)
    rand = lambda *shape: torch.randn(*shape, generator=generator).to(dtype)
    num_seqs, num_tokens = len(case.seq_lens), sum(case.query_lens)
    blocks_per_seq = [-(-n // case.block_size) for n in case.seq_lens]
    max_blocks = max(max(blocks_per_seq), 1)
    num_blocks = 1 + sum(blocks_per_seq) + 3
    block_ids = (1 + torch.randperm(num_blocks - 1, generator=generator)).tolist()
    block_tables = torch.zeros(num_seqs, max_blocks, dtype=torch.int32)
    for i, n in enumerate(blocks_per_seq):
        block_tables[i, :n] = torch.tensor([block_ids.pop() for _ in range(n)], dtype=torch.int32)

    query_start_loc = torch.tensor([0, *torch.tensor(case.query_lens).cumsum(0).tolist()], dtype=torch.int32)
    slot_of = lambda i, pos: int(block_tables[i, pos // case.block_size]) * case.block_size + pos % case.block_size
    slot_mapping = torch.full((num_tokens,), -1, dtype=torch.int64)
    cached_slots = []  # slots whose K/V are in the cache before this step
    for i, (query_len, seq_len) in enumerate(zip(case.query_lens, case.seq_lens)):
        cached_slots += [slot_of(i, pos) for pos in range(max(seq_len - query_len, 0))]
        for j in range(query_len if seq_len > 0 else 0):  # a padding row's token keeps slot -1
            token, slot = int(query_start_loc[i]) + j, slot_of(i, seq_len - query_len + j)
            if token in case.skip_slots:
                cached_slots.append(slot)
            else:
                slot_mapping[token] = slot
    cache_shape = (num_blocks, case.block_size, case.num_kv_heads, case.head_dim)
    k_cache, v_cache = (torch.full(cache_shape, float("nan"), dtype=dtype) for _ in range(2))
    for cache in (k_cache, v_cache):
        cache.view(-1, *cache_shape[2:])[cached_slots] = rand(len(cached_slots), *cache_shape[2:])

    # key/value are views of one packed qkv row, as a model produces them: token stride != heads * head_dim.
    qkv = rand(num_tokens, case.num_heads + 2 * case.num_kv_heads, case.head_dim)
    query, key, value = qkv.split([case.num_heads, case.num_kv_heads, case.num_kv_heads], dim=1)
    return dict(query=query, key=key, value=value, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping,
                query_start_loc=query_start_loc, seq_lens=torch.tensor(case.seq_lens, dtype=torch.int32),
                block_tables=block_tables)  # fmt: skip


def run_case(case: Case, generator: torch.Generator) -> dict:
    from pagedllm.attention.metadata import AttentionMetadata
    from pagedllm.attention.torch_backend import paged_attention
    from pagedllm.attention.torch_backend import store_kv_cache as reference_store
    from pagedllm.attention.triton_backend import TritonAttentionBackend
    from pagedllm.kernels import decode_attention, prefill_attention, store_kv_cache

    x = build_inputs(case, generator)
    decode_only = all(n == 1 for n in case.query_lens)
    metadata = AttentionMetadata(x["slot_mapping"], x["query_start_loc"], x["seq_lens"], x["block_tables"],
                                 max(case.query_lens), max(case.seq_lens), decode_only)  # fmt: skip
    scale = case.head_dim**-0.5
    ref_k, ref_v = x["k_cache"].clone(), x["v_cache"].clone()
    reference_store(x["key"], x["value"], ref_k, ref_v, x["slot_mapping"])
    query64 = x["query"].double()
    ref_out = paged_attention(query64, ref_k.nan_to_num().double(), ref_v.nan_to_num().double(), metadata, scale)

    k_cache, v_cache = x["k_cache"], x["v_cache"]
    if case.through_backend:
        out = TritonAttentionBackend().forward(x["query"], x["key"], x["value"], k_cache, v_cache, metadata, scale)
    else:
        store_kv_cache(x["key"], x["value"], k_cache, v_cache, x["slot_mapping"])
        out = torch.full_like(x["query"], float("nan"))
        if decode_only:
            decode_attention(x["query"], k_cache, v_cache, x["seq_lens"], x["block_tables"], scale, out=out,
                             **case.kernel_args)  # fmt: skip
        else:
            prefill_attention(x["query"], k_cache, v_cache, x["query_start_loc"], x["seq_lens"], x["block_tables"],
                              scale, out=out, **case.kernel_args)  # fmt: skip

    real = x["seq_lens"] > 0 if decode_only else torch.ones(out.shape[0], dtype=torch.bool)
    diff = (out[real].double() - ref_out[real]).norm() / ref_out[real].norm()
    return {
        "cache_matches": bool(torch.equal(k_cache.nan_to_num(7.0), ref_k.nan_to_num(7.0)))
        and bool(torch.equal(v_cache.nan_to_num(7.0), ref_v.nan_to_num(7.0))),
        "all_written": not bool(out.isnan().any()),
        "padding_rows_zero": bool((out[~real] == 0).all()),
        "rel_err": float(diff) if diff == diff else float("inf"),
    }


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    generator = torch.Generator().manual_seed(0)
    records = {}
    for name, case in CASES.items():
        try:
            records[name] = {**run_case(case, generator), "traceback": None, "case": asdict(case)}
        except Exception:
            import traceback

            records[name] = {"traceback": traceback.format_exc(), "case": asdict(case)}
    print(json.dumps(records))


if __name__ == "__main__":
    main()
