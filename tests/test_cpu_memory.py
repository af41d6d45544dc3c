"""cpu_memory: CPU tensors in maps of their own, asked for in 2 MiB pages."""

from __future__ import annotations

import gc

import pytest
import torch

from pagedllm.cpu_memory import HUGE_PAGE, mapped_copy, mapped_zeros


@pytest.mark.parametrize("shape", [(3, 5), (HUGE_PAGE // 4 + 7,), (2, HUGE_PAGE // 8)])
def test_mapped_zeros_start_on_a_huge_page_boundary_and_hold_zeros(shape):
    tensor = mapped_zeros(shape, torch.float32)
    assert tensor.shape == shape and tensor.is_contiguous() and tensor.dtype == torch.float32
    assert tensor.data_ptr() % HUGE_PAGE == 0
    assert not tensor.any()


def test_a_view_keeps_the_map_alive_and_writes_reach_it():
    tensor = mapped_zeros((4, 1000), torch.bfloat16)
    row = tensor[2]
    del tensor
    gc.collect()
    row.fill_(3.0)
    assert row.eq(3.0).all()


def test_mapped_copy_equals_its_source_and_empty_shapes_work():
    source = torch.randn(7, 33, 16)
    copy = mapped_copy(source)
    assert torch.equal(copy, source) and copy.data_ptr() != source.data_ptr()
    assert mapped_zeros((0, 4), torch.float32).shape == (0, 4)
