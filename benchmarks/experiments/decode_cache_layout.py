"""The decode kernel over a slot-major and a head-major KV cache, and a plain read of each (no attention).

A decode program (one sequence, one KV head) reads head_dim values of its KV head from every slot. In the slot-major
cache ([num_blocks, block_size, kv_heads, head_dim] contiguous) those are runs of head_dim * element_size bytes
(128 for an fp8 head of 128 or a 16-bit head of 64) kv_heads * head_dim elements apart; head-major
([num_blocks, kv_heads, block_size, head_dim] seen as the same shape, kernels/cache_layout.py) makes one KV head's
slots of a block one run (block_size * 128 bytes and up). Sessions 23 and 29 found the fp8 cache (and head_dim 64)
far below the copy rate whatever the kernel's arithmetic; this asks whether the runs' length is what they wait on.

Variants: the production kernel as the engine runs it; the same with the grid's KV heads fastest (a sequence's heads
in flight together, reading neighbouring runs); over a head-major copy of the same cache (outputs must be equal to
the bit: the same arithmetic); "read": every K/V value of each program's slots summed, no attention (the layout's own
ceiling; its output is not attention, so its error column is meaningless).
    python benchmarks/experiments/decode_cache_layout.py                        # GPU: checks and timings
    TRITON_INTERPRET=1 python benchmarks/experiments/decode_cache_layout.py --dry-run   # CPU: the checks
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_fma import sweep  # noqa: E402

# id of a slot-major cache -> (that cache, kept alive so its id is not reused; its head-major copy), made once
_HEAD_MAJOR: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}


def head_major_copy(cache: torch.Tensor | None) -> torch.Tensor | None:
    """The same values stored [num_blocks, kv_heads, block_size, head_dim], seen as cache's shape. Made on the
    untimed first call; the graph replays read the copy."""
    if cache is None or cache.dim() != 4:
        return cache
    if id(cache) not in _HEAD_MAJOR:
        _HEAD_MAJOR[id(cache)] = cache, cache.transpose(1, 2).contiguous().transpose(1, 2)
    return _HEAD_MAJOR[id(cache)][1]


def head_major_decode(query, k_cache, v_cache, seq_lens, block_tables, scale, out, **options):
    """decode_attention over the head-major copy; on its first call for a cache (untimed), also over the slot-major
    cache, printing whether the two outputs are equal to the bit."""
    from pagedllm.kernels.decode_attention import decode_attention

    first = id(k_cache) not in _HEAD_MAJOR
    slot_major = decode_attention(query, k_cache, v_cache, seq_lens, block_tables, scale, **options) if first else None
    k_cache, v_cache = head_major_copy(k_cache), head_major_copy(v_cache)
    decode_attention(query, k_cache, v_cache, seq_lens, block_tables, scale, out, **options)
    if first:
        print(f"head-major {options}: bit-equal to slot-major: {torch.equal(out, slot_major)}", flush=True)
    return out


@triton.jit
def _read_kernel(
    out_ptr, k_cache_ptr, v_cache_ptr, seq_lens_ptr, block_tables_ptr, stride_out_seq, stride_cache_block,
    stride_cache_slot, stride_cache_head, stride_block_table_seq, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
):  # fmt: skip
    # Program (seq, kv_head, split): the production kernel's addressing, its loads summed instead of attended.
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    num_tiles = tl.cdiv(seq_len, BLOCK_N)
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    tile_begin = split * tiles_per_split
    tile_end = tl.minimum(tile_begin + tiles_per_split, num_tiles)
    dims = tl.arange(0, HEAD_DIM)
    total = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    block_table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_block_table_seq
    for tile in range(tile_begin, tile_end):
        key_pos = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        valid = key_pos < seq_len
        block_ids = tl.load(block_table_ptr + key_pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        offsets = block_ids * stride_cache_block + (key_pos % BLOCK_SIZE) * stride_cache_slot
        offsets = offsets[:, None] + kv_head * stride_cache_head + dims[None, :]
        total += tl.load(k_cache_ptr + offsets, mask=valid[:, None], other=0.0).to(tl.float32)
        total += tl.load(v_cache_ptr + offsets, mask=valid[:, None], other=0.0).to(tl.float32)
    row = seq.to(tl.int64) * stride_out_seq + (kv_head * GROUP) * HEAD_DIM
    tl.store(out_ptr + row + dims, tl.sum(total, 0).to(out_ptr.dtype.element_ty))  # splits overwrite: a probe


def read_only(query, k_cache, v_cache, seq_lens, block_tables, scale, out, layout="slot", block_n=64,
              num_warps=4, num_stages=3, k_scale=None, v_scale=None):  # fmt: skip
    from pagedllm.kernels.cache_layout import cache_strides
    from pagedllm.kernels.decode_attention import default_num_splits

    if layout == "head":
        k_cache, v_cache = head_major_copy(k_cache), head_major_copy(v_cache)
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    strides = cache_strides(k_cache, v_cache)
    _read_kernel[(num_seqs, num_kv_heads, default_num_splits(num_seqs, num_kv_heads, query.device))](
        out, k_cache, v_cache, seq_lens, block_tables, out.stride(0), strides.block, strides.slot, strides.head,
        block_tables.stride(0), GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_N=block_n, NUM_SPLITS=default_num_splits(num_seqs, num_kv_heads, query.device), num_warps=num_warps,
        num_stages=num_stages,
    )  # fmt: skip
    return out


def layout_variants(cache: str, dry_run: bool) -> list:
    from pagedllm.kernels import decode_attention

    rows = [
        ("production", decode_attention, {}),
        ("production", decode_attention, {"heads_fastest": True}),
        ("head-major", head_major_decode, {}),
        ("head-major", head_major_decode, {"heads_fastest": True}),
    ]
    if not dry_run:
        rows += [("read", read_only, {"layout": layout}) for layout in ("slot", "head")]
    return rows


if __name__ == "__main__":
    sweep(layout_variants, "decode_cache_layout.json", skip_shapes=("dry 2 x 30",))
