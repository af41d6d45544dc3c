"""The CUDA-core decode kernel for small GQA groups against a plain torch reference, under the Triton interpreter
(TRITON_INTERPRET=1, in a child process: Triton decides interpret-or-compile when a kernel is decorated)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

CASES = {  # name: (seq_lens, num_heads, num_kv_heads, head_dim, block_size, cache dtype, num_splits, block_n)
    "group2_splits": ((37, 0, 64, 5), 4, 2, 32, 16, "float32", 3, 16),
    "group1_one_split": ((20, 33), 2, 2, 64, 16, "float32", 1, 16),
    "group4_head_dim80": ((45, 9, 0), 8, 2, 80, 32, "float32", 2, 32),
    "group3_head_dim96": ((19, 70), 6, 2, 96, 16, "float32", 4, 16),
    "fp8_group2": ((50, 7, 33), 4, 2, 64, 16, "fp8", 2, 16),
    "fp8_group2_head_dim80": ((41, 0, 12), 8, 4, 80, 32, "fp8", 3, 32),
}


def reference(query, keys, values, seq_lens, scale) -> torch.Tensor:
    """keys/values [num_seqs, max_len, num_kv_heads, head_dim], float32, the context of each sequence."""
    num_seqs, num_heads, _ = query.shape
    group = num_heads // keys.shape[2]
    out = torch.zeros_like(query)
    for seq, length in enumerate(seq_lens):
        if length == 0:
            continue
        k = keys[seq, :length].repeat_interleave(group, dim=1)  # [length, num_heads, head_dim]
        v = values[seq, :length].repeat_interleave(group, dim=1)
        weights = torch.einsum("hd,lhd->hl", query[seq], k).mul(scale).softmax(dim=-1)
        out[seq] = torch.einsum("hl,lhd->hd", weights, v)
    return out


def run_case(name: str) -> float:
    from pagedllm.kernels.decode_attention_small_group import decode_attention_small_group
    from pagedllm.kernels.kv_store import store_kv_cache

    seq_lens, num_heads, num_kv_heads, head_dim, block_size, cache_dtype, num_splits, block_n = CASES[name]
    generator = torch.Generator().manual_seed(len(name))
    num_seqs, max_len = len(seq_lens), max(seq_lens)
    blocks_per_seq = -(-max_len // block_size)
    num_blocks = num_seqs * blocks_per_seq + 3
    # Scattered blocks: each sequence's table is a random choice of the pool.
    block_tables = torch.randperm(num_blocks, generator=generator)[: num_seqs * blocks_per_seq]
    block_tables = block_tables.view(num_seqs, blocks_per_seq).to(torch.int32)
    keys = torch.randn(num_seqs, max_len, num_kv_heads, head_dim, generator=generator)
    values = torch.randn(num_seqs, max_len, num_kv_heads, head_dim, generator=generator)
    fp8 = cache_dtype == "fp8"
    storage = torch.float8_e4m3fn if fp8 else torch.float32
    k_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=storage)
    v_cache = torch.zeros_like(k_cache)
    k_scale = torch.zeros(num_blocks, num_kv_heads, block_size) if fp8 else None
    v_scale = torch.zeros_like(k_scale) if fp8 else None
    positions = torch.arange(max_len)
    slots = block_tables[:, positions // block_size].long() * block_size + positions % block_size  # [seqs, max_len]
    store_kv_cache(keys.flatten(0, 1), values.flatten(0, 1), k_cache, v_cache, slots.flatten(), k_scale, v_scale)
    if fp8:  # the reference attends over what the cache holds: the stored values times their scales
        flat_k = k_cache.view(-1, num_kv_heads, head_dim).float() * k_scale.transpose(1, 2).reshape(-1, num_kv_heads, 1)
        flat_v = v_cache.view(-1, num_kv_heads, head_dim).float() * v_scale.transpose(1, 2).reshape(-1, num_kv_heads, 1)
        keys, values = flat_k[slots], flat_v[slots]
    query = torch.randn(num_seqs, num_heads, head_dim, generator=generator)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    scale = head_dim**-0.5
    out = decode_attention_small_group(
        query, k_cache, v_cache, lens, block_tables, scale, num_splits=num_splits, block_n=block_n,
        k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip
    expected = reference(query, keys, values, seq_lens, scale)
    return ((out - expected).abs().max() / expected.abs().max().clamp_min(1e-6)).item()


@pytest.fixture(scope="module")
def errors() -> dict:
    root = str(Path(__file__).resolve().parents[2])
    env = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", sorted(CASES))
def test_small_group_decode_matches_the_reference(errors, name):
    assert errors[name] < 1e-5, f"{name}: max relative error {errors[name]:.2e}"


if __name__ == "__main__":
    print(json.dumps({name: run_case(name) for name in CASES}))
