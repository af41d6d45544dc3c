"""The CPU layer ops (layers/cpu_layer_ops.cpp) against the torch expressions they replace (layers/norm.py,
activation.py, rotary.py, attention/torch_backend.store_kv_cache), on random rows of each float dtype: the rotation
and the store bit for bit, the norms and SiLU to a few float32 ulps (another order of the sum of squares, another
exponential) or one rounding step of a 16-bit dtype; a row's bits whatever rows stand beside it; wrong inputs
refused with a message."""

from __future__ import annotations

import pytest
import torch

from pagedllm import cpu_kernels
from pagedllm.attention.torch_backend import store_kv_cache
from pagedllm.layers.activation import silu_and_mul
from pagedllm.layers.norm import add_rms_norm, rms_norm
from pagedllm.layers.rotary import RotaryEmbedding, apply_rotary

ops = torch.ops.pagedllm_cpu
# dtype -> (relative tolerance of a float32-summed result, absolute tolerance)
TOLERANCES = {torch.float32: (2e-6, 1e-6), torch.bfloat16: (8e-3, 1e-2), torch.float16: (1e-3, 1e-3)}
DTYPES = list(TOLERANCES)


@pytest.fixture(scope="module", autouse=True)
def kernels():
    cpu_kernels.require()


def close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    rtol, atol = TOLERANCES[dtype]
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual.float(), expected.float(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, hidden", [(1, 576), (7, 64), (300, 1000), (3, 13)])
def test_norms_equal_the_torch_expressions(dtype, rows, hidden):
    generator = torch.Generator().manual_seed(rows * hidden)
    x = (torch.randn(rows, hidden, generator=generator) * 3).to(dtype)
    residual = torch.randn(rows, hidden, generator=generator).to(dtype)
    weight = (torch.rand(hidden, generator=generator) + 0.5).to(dtype)
    close(ops.rms_norm(x, weight, 1e-5), rms_norm(x, weight, 1e-5), dtype)
    out, summed = ops.add_rms_norm(x, residual, weight, 1e-6)
    expected_out, expected_summed = add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(summed, expected_summed)  # one rounded add: exact
    close(out, expected_out, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_equals_the_torch_expression_over_the_whole_range(dtype):
    generator = torch.Generator().manual_seed(1)
    gate = torch.cat([torch.randn(5, 1536, generator=generator) * 4, torch.linspace(-100, 100, 1536).expand(1, -1)])
    gate_up = torch.cat([gate, torch.randn(6, 1536, generator=generator)], dim=1).to(dtype)
    close(ops.silu_and_mul(gate_up), silu_and_mul(gate_up), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(9, 3, 64), (16, 8, 128), (4, 4, 72)])
def test_rotation_in_place_equals_the_rotary_layer(dtype, qk_norm, heads, kv_heads, head_dim):
    generator = torch.Generator().manual_seed(heads * head_dim + qk_norm)
    tokens = 11
    rotary = RotaryEmbedding(head_dim, max_position=4096, theta=10000.0)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=generator).to(dtype)
    positions = torch.randint(0, 4096, (tokens,), generator=generator)
    q_norm = (torch.rand(head_dim, generator=generator) + 0.5).to(dtype) if qk_norm else None
    k_norm = (torch.rand(head_dim, generator=generator) + 0.5).to(dtype) if qk_norm else None
    q_size, k_size = heads * head_dim, kv_heads * head_dim
    query = qkv[:, :q_size].view(tokens, heads, head_dim)
    key = qkv[:, q_size : q_size + k_size].view(tokens, kv_heads, head_dim)
    if qk_norm:
        query, key = rms_norm(query, q_norm, 1e-6), rms_norm(key, k_norm, 1e-6)
    rows = rotary.rows(positions)
    expected = torch.cat(
        [apply_rotary(query, *rows).flatten(1), apply_rotary(key, *rows).flatten(1), qkv[:, q_size + k_size :]], dim=1
    )
    rotated = qkv.clone()
    ops.rotate_qk_(rotated, positions, rotary.cos_sin, heads, kv_heads, head_dim, q_norm, k_norm, 1e-6)
    if qk_norm:  # the norms' sums of squares run in another order
        close(rotated, expected, dtype)
    else:
        assert torch.equal(rotated, expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_writes_the_slots_the_torch_store_writes(dtype):
    generator = torch.Generator().manual_seed(2)
    num_blocks, block_size, kv_heads, head_dim, tokens = 6, 4, 2, 8, 9
    qkv = torch.randn(tokens, 5 * kv_heads * head_dim, generator=generator).to(dtype)
    key = qkv[:, : kv_heads * head_dim].view(tokens, kv_heads, head_dim)  # views into qkv, as the layer's
    value = qkv[:, kv_heads * head_dim : 2 * kv_heads * head_dim].view(tokens, kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=generator)[:tokens]
    slots[[2, 5]] = -1  # tokens whose K/V is not stored
    caches = [torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=generator).to(dtype) for _ in range(2)]
    expected = [cache.clone() for cache in caches]
    store_kv_cache(key, value, *expected, slots)
    ops.store_kv_(key, value, *caches, slots)
    assert torch.equal(caches[0], expected[0]) and torch.equal(caches[1], expected[1])


def test_a_rows_bits_do_not_depend_on_the_rows_beside_it():
    generator = torch.Generator().manual_seed(3)
    rows = torch.randn(4000, 576, generator=generator)  # enough rows for every thread to take some
    weight = torch.rand(576, generator=generator)
    alone = torch.cat([ops.rms_norm(rows[i : i + 1], weight, 1e-5) for i in (0, 1999, 3999)])
    together = ops.rms_norm(rows, weight, 1e-5)[[0, 1999, 3999]]
    assert torch.equal(alone, together)
    gate_up = torch.randn(4000, 2 * 576, generator=generator)
    assert torch.equal(ops.silu_and_mul(gate_up[1999:2000]), ops.silu_and_mul(gate_up)[1999:2000])


def test_wrong_inputs_are_refused_with_what_is_expected():
    x = torch.randn(2, 8)
    with pytest.raises(RuntimeError, match="the weight is \\[hidden\\]"):
        ops.rms_norm(x, torch.ones(7), 1e-6)
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        ops.silu_and_mul(torch.ones(2, 8, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="outside the rotary table"):
        ops.rotate_qk_(torch.randn(1, 24), torch.tensor([9]), torch.randn(4, 8), 1, 1, 8, None, None, 1e-6)
    cache = torch.zeros(2, 2, 1, 4)
    with pytest.raises(RuntimeError, match="slot 4 of token 0 is outside"):
        ops.store_kv_(torch.ones(1, 1, 4), torch.ones(1, 1, 4), cache, cache.clone(), torch.tensor([4]))
