"""choose_backend: the backend asked for, or torch with one warning when the Triton kernels cannot take the model or
the CPU kernels cannot be built."""

from __future__ import annotations

import logging

import pytest
import torch

from pagedllm import cpu_kernels
from pagedllm.attention.selector import choose_backend, create_backend
from pagedllm.logger import logger


@pytest.fixture
def warnings(caplog):
    logger.addHandler(caplog.handler)  # the pagedllm logger does not propagate to the root logger
    caplog.set_level(logging.WARNING, logger="pagedllm")
    yield caplog
    logger.removeHandler(caplog.handler)


@pytest.mark.parametrize("head_dim", [8, 64, 80, 96, 128, 136, 256])
def test_triton_takes_every_head_dim_that_is_a_multiple_of_8_up_to_256(head_dim, warnings):
    assert choose_backend("triton", torch.device("cpu"), head_dim) == "triton"
    assert choose_backend("triton", torch.device("cpu"), head_dim, "fp8") == "triton"
    assert not warnings.records


@pytest.mark.parametrize("head_dim", [4, 100, 264, 512])
def test_other_head_dims_fall_back_to_torch_with_one_warning(head_dim, warnings):
    assert choose_backend("triton", torch.device("cpu"), head_dim) == "torch"
    assert len(warnings.records) == 1
    assert f"head_dim {head_dim}" in warnings.text and "using the torch backend" in warnings.text


def test_default_is_the_in_place_kernel_on_cpu_and_torch_stays_torch(warnings):
    assert choose_backend(None, torch.device("cpu"), 64, "fp8") == "cpu"
    assert choose_backend("cpu", torch.device("cpu"), 100) == "cpu"
    assert choose_backend("torch", torch.device("cpu"), 100) == "torch"
    assert not warnings.records


def test_cpu_kernels_that_cannot_be_built_fall_back_to_torch_with_one_warning(monkeypatch, warnings):
    reason = "the CPU kernels could not be built (OSError: no compiler)"
    monkeypatch.setattr(cpu_kernels, "unavailable_reason", lambda: reason)
    assert choose_backend(None, torch.device("cpu"), 64) == "torch"
    assert len(warnings.records) == 1
    assert f"attention: {reason}; using the torch backend" in warnings.text


@pytest.mark.parametrize("name", ["torch", "triton", "cpu"])
def test_the_chosen_name_builds_that_backend(name):
    assert create_backend(name).name == name
