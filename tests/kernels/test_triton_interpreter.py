"""The Triton kernels against the torch reference backend on CPU, under the Triton interpreter (TRITON_INTERPRET=1).

Triton decides interpret-or-compile when a kernel is decorated, so the steps run in one child process that sets the
variable before importing pagedllm.kernels; nothing leaks into other test modules. The child is this file run as a
script: it prints one JSON record of checks per step. Shapes are small: the interpreter runs every program in Python.
"""

from __future__ import annotations

import json
import os
import traceback
from dataclasses import asdict

import pytest
import torch
from interpreter_child import interpreter_results
from paged_batch import Step, bitwise_equal, check_step, make_batch, run_kernels
from rotary_case import rotate_case

PREFILL_TILES = {"block_m": 16, "block_n": 16}
# A program costs the interpreter ~20 ms here (a KV tile ~9 ms more, a token stored to fp8 ~30 ms), so each step is
# the smallest that keeps its paths: a prefill step keeps a sequence of several query tiles with a partial last one,
# and keys both in full tiles (the unmasked loop) and in the causal tile; decode steps keep their splits' shapes
# (several tiles to a split, a short last split, empty splits, padding rows).
STEPS = {
    "fresh_prefill": Step((19, 8, 1), (19, 8, 1), kernel_args=PREFILL_TILES),
    "fresh_prefill_fp16_group1": Step((7, 20), (7, 20), 2, 2, dtype="float16", kernel_args=PREFILL_TILES),
    "prefix_hit": Step((5, 9), (37, 41), 8, 2, block_size=32, kernel_args=PREFILL_TILES),
    "chunked_prefill": Step((12, 12), (40, 12), 4, 1, kernel_args={"block_m": 32, "block_n": 32}),
    "mixed_batch_fp16": Step((1, 11, 1, 12), (40, 11, 7, 27), dtype="float16", kernel_args=PREFILL_TILES),
    "mixed_batch_group3": Step((1, 7, 11), (33, 7, 25), 6, 2, block_size=32, kernel_args=PREFILL_TILES),
    "mixed_batch_head_dim128": Step((2, 13), (20, 29), 4, 1, head_dim=128, kernel_args=PREFILL_TILES),
    "mixed_batch_head_dim80": Step((3, 14), (30, 14), 4, 2, head_dim=80, kernel_args=PREFILL_TILES),
    "mixed_batch_head_dim96_fp16": Step((1, 17), (21, 40), 4, 1, 96, dtype="float16", kernel_args=PREFILL_TILES),
    "skipped_slots": Step((12, 9), (30, 9), skip_slots=(0, 5, 13), kernel_args=PREFILL_TILES),
    "prefill_backend_defaults": Step((20, 3), (70, 45), 8, 2, dtype="float16", through_backend=True),
    "decode_one_split": Step((1,) * 4, (21, 1, 32, 0), kernel_args={"num_splits": 1, "block_n": 16}),
    "decode_splits_group4": Step((1,) * 4, (0, 70, 17, 33), 8, 2, kernel_args={"num_splits": 3, "block_n": 16}),
    "decode_fp16_block32": Step((1,) * 3, (70, 5, 40), 2, 1, 64, 32, "float16", kernel_args={"num_splits": 4}),
    "decode_head_dim80_splits": Step((1,) * 3, (40, 0, 23), 4, 2, 80, kernel_args={"num_splits": 2, "block_n": 16}),
    "decode_head_dim96": Step((1,) * 2, (33, 9), 2, 1, 96, kernel_args={"num_splits": 1, "block_n": 16}),
    "decode_head_dim8": Step((1,) * 2, (19, 5), 2, 2, 8, kernel_args={"num_splits": 2, "block_n": 16}),
    "decode_backend_defaults": Step((1,) * 3, (129, 0, 64), 8, 4, dtype="float16", through_backend=True),
    "decode_skipped_slot": Step((1,) * 3, (20, 33, 0), skip_slots=(2,), kernel_args={"num_splits": 2}),
    # fp8 cache: the kernels quantize on store and attend over the upcast values
    "fp8_mixed_batch": Step((1, 9, 5), (40, 9, 20), kv_cache_dtype="fp8", skip_slots=(4,), kernel_args=PREFILL_TILES),
    "fp8_prefix_hit_head_dim80_fp16": Step((5, 3), (37, 35), 4, 1, 80, 32, "float16", "fp8", kernel_args=PREFILL_TILES),
    "fp8_decode_splits": Step((1,) * 3, (0, 70, 17), 8, 2, kv_cache_dtype="fp8", kernel_args={"num_splits": 3}),
    "fp8_decode_head_dim96": Step((1,) * 2, (45, 3), 2, 1, 96, kv_cache_dtype="fp8", kernel_args={"block_n": 16}),
    "fp8_prefill_backend_defaults": Step(
        (17, 3), (70, 30), 8, 2, dtype="float16", kv_cache_dtype="fp8", through_backend=True
    ),
    # fp8 cache, both dots in float16 (fp8_via_f16): head_dim 64/80/128, GQA groups 1 to 4, tile widths 16 to 256
    "fp8_via_f16_decode_group1_head_dim64": Step((1,) * 3, (40, 0, 17), 2, 2, 64, kv_cache_dtype="fp8",
                                                 kernel_args={"fp8_via_f16": True, "num_splits": 2, "block_n": 16}),
    "fp8_via_f16_decode_group2_head_dim128": Step((1,) * 4, (0, 90, 17, 33), 4, 2, 128, kv_cache_dtype="fp8",
                                                  kernel_args={"fp8_via_f16": True, "block_n": 32}),
    "fp8_via_f16_decode_group4_head_dim80": Step((1,) * 3, (40, 21, 0), 8, 2, 80, 32, "float16", "fp8",
                                                 kernel_args={"fp8_via_f16": True, "num_splits": 3, "block_n": 16}),
    "fp8_via_f16_decode_block_n256": Step((1,) * 2, (300, 45), 4, 2, 128, kv_cache_dtype="fp8",
                                          kernel_args={"fp8_via_f16": True, "num_splits": 1, "block_n": 256}),
    "fp8_via_f16_prefill_head_dim80_group2": Step((1, 9, 5), (40, 9, 20), 4, 2, 80, kv_cache_dtype="fp8",
                                                  kernel_args={**PREFILL_TILES, "fp8_via_f16": True}),
    "fp8_via_f16_prefill_head_dim64_group1": Step((5, 3), (37, 35), 2, 2, 64, 32, "float16", "fp8",
                                                  kernel_args={**PREFILL_TILES, "fp8_via_f16": True}),
    # values ~2^-20: p * v_scale would underflow float16 (zeros) unless the tile's largest v_scale is factored out
    "fp8_via_f16_decode_tiny_values": Step((1,) * 2, (70, 17), 4, 2, 64, kv_cache_dtype="fp8", value_scale=2**-20,
                                           kernel_args={"fp8_via_f16": True, "block_n": 16}),
    "fp8_via_f16_prefill_tiny_values": Step((3, 9), (20, 9), 4, 2, 64, kv_cache_dtype="fp8", value_scale=2**-20,
                                            kernel_args={**PREFILL_TILES, "fp8_via_f16": True}),
    # a float16 model with an fp8 cache (dots in f16 whatever the switch): values ~2^-11 are normal f16 numbers, but
    # p * v_scale (~2^-19 and less) is not: 1-2% error before the launchers took the tile-relative scales for f16
    "fp8_fp16_model_decode_small_values": Step((1,) * 2, (70, 17), 4, 2, 64, dtype="float16", kv_cache_dtype="fp8",
                                              value_scale=2**-11, kernel_args={"block_n": 16}),
    "fp8_fp16_model_prefill_small_values": Step((3, 9), (20, 9), 4, 2, 64, dtype="float16", kv_cache_dtype="fp8",
                                               value_scale=2**-11, kernel_args=PREFILL_TILES),
}  # fmt: skip
TOLERANCE = {"float32": 1e-5, "float16": 3e-3}


def tolerance(step: Step) -> float:
    """Relative error allowed: the precision the dots run in (float16 with fp8_via_f16, else the model's dtype)."""
    return TOLERANCE["float16" if step.kernel_args.get("fp8_via_f16") else step.dtype]


@pytest.fixture(scope="module")
def results() -> dict:
    return interpreter_results(__file__)


@pytest.mark.parametrize("name", STEPS)
def test_kernels_match_torch_reference(results: dict, name: str) -> None:
    record = results[name]
    assert record["traceback"] is None, record["traceback"]
    assert record["cache_matches"], "store_kv_cache wrote other bytes than the reference store (values or scales)"
    assert record["all_written"], "some output element is still NaN (unwritten, or read an unused cache slot)"
    assert record["padding_rows_zero"], "a padding row (seq_len 0) must come out as zeros"
    assert record["rel_err"] < tolerance(STEPS[name]), record


def test_fp8_tiles_of_unwritten_slots_add_nothing(results: dict) -> None:
    """With fp8_via_f16 (and every float16 model), a tile whose value scales are all 0 used to give 0 / 0 = NaN."""
    record = results["zero_scale_tiles"]
    assert record["traceback"] is None, record["traceback"]
    assert record["nan"] == [False, False], record
    assert record["max_diff_to_bf16_dots_path"] < 1e-2, record


def test_a_step_padded_to_a_prefill_graph_computes_the_same(results: dict) -> None:
    """Padding tokens that belong to no sequence (slot -1) and empty sequences, as pad_prefill_plan adds them: the
    real rows' output and the cache come out bit for bit as without the padding."""
    record = results["padded_prefill"]
    assert record["traceback"] is None, record["traceback"]
    assert record["same_rows"] and record["same_cache"], record


def padded_prefill() -> dict:
    """A mixed step (a decode row and two prompt chunks, fp8 cache) through the store and prefill kernels, then the
    same step padded with 11 tokens and 5 empty sequences on a copy of the cache."""
    from pagedllm.kernels import prefill_attention, store_kv_cache

    step = Step((1, 9, 5), (40, 9, 20), kv_cache_dtype="fp8", kernel_args=PREFILL_TILES)
    batch = make_batch(step, torch.Generator().manual_seed(2))
    md, scale = batch.metadata, step.head_dim**-0.5
    padded_caches = [cache.clone() for cache in batch.caches()]
    plain = run_kernels(batch, step, scale)

    num_tokens, extra_tokens, extra_seqs = batch.query.shape[0], 11, 5
    pad_rows = lambda t: torch.cat([t, torch.randn(extra_tokens, *t.shape[1:]).to(t.dtype)])  # noqa: E731
    query, key, value = pad_rows(batch.query), pad_rows(batch.key), pad_rows(batch.value)
    slots = torch.cat([md.slot_mapping, torch.full((extra_tokens,), -1, dtype=md.slot_mapping.dtype)])
    query_start_loc = torch.cat([md.query_start_loc, md.query_start_loc[-1:].repeat(extra_seqs)])
    seq_lens = torch.cat([md.seq_lens, torch.zeros(extra_seqs, dtype=md.seq_lens.dtype)])
    k_cache, v_cache, k_scale, v_scale = padded_caches
    store_kv_cache(key, value, k_cache, v_cache, slots, k_scale, v_scale)
    out = torch.full_like(query, float("nan"))
    prefill_attention(query, k_cache, v_cache, query_start_loc, seq_lens, md.block_tables, scale, out=out,
                      k_scale=k_scale, v_scale=v_scale, **step.kernel_args)  # fmt: skip
    return {
        "same_rows": bitwise_equal(out[:num_tokens], plain),
        "same_cache": all(bitwise_equal(a, b) for a, b in zip(padded_caches, batch.caches())),
        "traceback": None,
    }


# (num_q_heads, num_kv_heads, head_dim, dtype, norm): Qwen3-like, TinyLlama-like (no norm), head_dim 80, float16
ROTATE_CASES = {
    "qwen3_like": (16, 8, 128, "float32", True),
    "tinyllama_like": (32, 4, 64, "float32", False),
    "head_dim80_float16": (4, 2, 80, "float16", True),
    "group3_float16_no_norm": (6, 2, 96, "float16", False),
}


@pytest.mark.parametrize("name", ROTATE_CASES)
def test_qk_norm_and_rotation_in_place_match_torch(results: dict, name: str) -> None:
    """kernels/rotary.rotate_qk_ against layers/norm.rms_norm and layers/rotary.apply_rotary (the CPU path)."""
    record = results[f"rotate_{name}"]
    assert record["traceback"] is None, record["traceback"]
    assert record["values_untouched"], "the value heads must not change"
    assert record["rel_err"] < TOLERANCE[ROTATE_CASES[name][3]], record


def zero_scale_tiles() -> dict:
    """Decode over a block table whose second row points at blocks never written (scales 0), both conversions."""
    from pagedllm.kernels.decode_attention import decode_attention

    generator = torch.Generator().manual_seed(1)
    num_blocks, block_size, num_kv_heads, head_dim = 8, 16, 2, 64
    query = torch.randn(2, 4, head_dim, generator=generator).to(torch.float16)
    k_cache, v_cache = (torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=generator)
                        .to(torch.float8_e4m3fn) for _ in range(2))  # fmt: skip
    scales = torch.ones(num_blocks, num_kv_heads, block_size)
    scales[4:] = 0.0
    tables = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]], dtype=torch.int32)
    seq_lens = torch.tensor([40, 40], dtype=torch.int32)
    outputs = [
        decode_attention(
            query.float() if f32 else query,
            k_cache,
            v_cache,
            seq_lens,
            tables,
            head_dim**-0.5,
            k_scale=scales,
            v_scale=scales,
            block_n=16,
            num_splits=1,
        )  # fmt: skip
        for f32 in (False, True)  # float16 query: the f16-dots path; float32: the scales multiply the probabilities
    ]
    return {
        "nan": outputs[0].isnan().any(dim=(1, 2)).tolist(),
        "max_diff_to_bf16_dots_path": (outputs[0].float() - outputs[1]).abs().max().item(),
        "traceback": None,
    }


def main() -> None:
    """The child process: every step under the interpreter."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    generator = torch.Generator().manual_seed(0)
    records = {}
    for name, step in STEPS.items():
        try:
            records[name] = {**check_step(step, generator), "traceback": None, "step": asdict(step)}
        except Exception:
            records[name] = {"traceback": traceback.format_exc(), "step": asdict(step)}
    try:
        records["zero_scale_tiles"] = zero_scale_tiles()
    except Exception:
        records["zero_scale_tiles"] = {"traceback": traceback.format_exc()}
    try:
        records["padded_prefill"] = padded_prefill()
    except Exception:
        records["padded_prefill"] = {"traceback": traceback.format_exc()}
    for name, case in ROTATE_CASES.items():
        try:
            records[f"rotate_{name}"] = rotate_case(*case)
        except Exception:
            records[f"rotate_{name}"] = {"traceback": traceback.format_exc()}
    print(json.dumps(records))


if __name__ == "__main__":
    main()
