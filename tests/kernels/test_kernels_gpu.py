"""The Triton kernels compiled on a CUDA GPU against the torch reference (run there: `pytest -m gpu tests/kernels`).

Every GQA group 1..8, head_dim 64/80/96/128, block sizes 16..256, bf16 and fp16, 16-bit and fp8 caches, spread
so that each value meets several of the others. Each combination checks store + prefill on a step mixing fresh
prefill, a prefix hit, a chunk, a decode row, a 1-token prompt and a skipped slot, and store + decode of 24
sequences (3 padding rows) at the default number of splits and at 1; with an fp8 cache also both with fp8_via_f16.
Timings: benchmarks/attention_kernels.py.
"""

from __future__ import annotations

import pytest
import torch
from paged_batch import Step, check_step, make_batch
from rotary_case import rotate_case

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the GPU machine)"),
]

BLOCK_SIZES = (16, 32, 64, 128, 256)
DTYPES = ("bfloat16", "float16")
HEAD_DIMS = (64, 80, 96, 128)
TOLERANCE = 1e-2  # relative error against the float64 reference; bf16 measured up to 2.2e-3


def combinations() -> list[tuple[int, int, int, str, str]]:
    """(group, head_dim, block_size, dtype, kv_cache_dtype): two groups per (head_dim, cache dtype), cycling."""
    combos = []
    for index in range(2 * len(HEAD_DIMS) * 2):
        head_dim = HEAD_DIMS[index // 4]
        kv_cache_dtype = ("auto", "fp8")[index // 2 % 2]
        group = (3 * index) % 8 + 1
        combos.append((group, head_dim, BLOCK_SIZES[index % 5], DTYPES[index % 2], kv_cache_dtype))
    return combos


def steps(group: int, head_dim: int, block_size: int, dtype: str, kv_cache_dtype: str) -> dict[str, Step]:
    shape = dict(num_heads=2 * group, num_kv_heads=2, head_dim=head_dim, block_size=block_size, dtype=dtype,
                 kv_cache_dtype=kv_cache_dtype)  # fmt: skip
    generator = torch.Generator().manual_seed(group * 1000 + head_dim)
    decode_lens = torch.randint(1, 1500, (24,), generator=generator)
    decode_lens[[3, 17, 23]] = 0  # padding rows of a captured batch
    # fresh 300, prefix hit 57 of 400, chunk 256 of 700, decode at 1000, fresh 1, fresh 129
    result = {"prefill": Step((300, 57, 256, 1, 1, 129), (300, 400, 700, 1000, 1, 129), skip_slots=(3,), **shape)}
    for num_splits in (None, 1):  # None: as many as fill the GPU (11 on an H200 for 24 x 2 KV heads)
        args = {} if num_splits is None else {"num_splits": num_splits}
        result[f"decode splits={num_splits}"] = Step((1,) * 24, tuple(decode_lens.tolist()), kernel_args=args, **shape)
    if kv_cache_dtype == "fp8":  # both dots in float16 (off by default): compiled, not only interpreted
        f16 = {"fp8_via_f16": True}
        result["prefill fp8_via_f16"] = Step((300, 57, 1), (300, 400, 129), kernel_args=f16, **shape)
        result["decode fp8_via_f16"] = Step((1,) * 24, tuple(decode_lens.tolist()), kernel_args=f16, **shape)
    return result


@pytest.mark.parametrize("combo", combinations(), ids=lambda c: f"group{c[0]}-hd{c[1]}-block{c[2]}-{c[3]}-kv_{c[4]}")
def test_kernels_match_torch_reference(combo):
    generator = torch.Generator().manual_seed(0)
    for name, step in steps(*combo).items():
        record = check_step(step, generator, device="cuda")
        assert record["cache_matches"], f"{name}: store wrote other bytes than the reference store"
        assert record["all_written"], f"{name}: NaN in the output (unwritten, or read an unused cache slot)"
        assert record["padding_rows_zero"], f"{name}: a padding row must come out as zeros"
        assert record["rel_err"] < TOLERANCE, f"{name}: {record}"


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("head_dim", [128, 80])
def test_decode_graph_replay_matches_eager(kv_cache_dtype, head_dim):
    """Capture decode in a CUDA graph, change seq_lens and block tables in place, replay: equal to eager."""
    from pagedllm.kernels import decode_attention

    step = Step((1,) * 64, (700,) * 50 + (0,) * 14, 16, 8, head_dim, 16, "bfloat16", kv_cache_dtype)
    batch = make_batch(step, torch.Generator().manual_seed(0), "cuda", poison=False)
    md, scales = batch.metadata, dict(k_scale=batch.k_scale, v_scale=batch.v_scale)
    out = torch.empty_like(batch.query)
    args = (batch.query, batch.k_cache, batch.v_cache, md.seq_lens, md.block_tables, head_dim**-0.5)
    decode_attention(*args, out=out, **scales)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode_attention(*args, out=out, **scales)
    md.seq_lens.copy_(torch.randint(0, 701, md.seq_lens.shape, device="cuda").int())
    md.block_tables.copy_(md.block_tables[torch.randperm(64, device="cuda")])
    graph.replay()
    eager = decode_attention(*args, **scales)
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    assert not out.isnan().any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "heads", [(16, 8, 128, True), (32, 4, 64, False), (4, 2, 80, True), (6, 2, 96, False), (8, 1, 64, True)]
)
def test_qk_norm_and_rotation_match_torch(heads, dtype):
    """kernels/rotary.rotate_qk_ compiled, against the torch path in the same dtype (one rounding apart at most)."""
    num_q_heads, num_kv_heads, head_dim, norm = heads
    record = rotate_case(num_q_heads, num_kv_heads, head_dim, dtype, norm, device="cuda")
    assert record["values_untouched"]
    assert record["rel_err"] < TOLERANCE, record
