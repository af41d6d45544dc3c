"""EngineConfig.resolve: every default made concrete once, for the machine and the checkpoint."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
import types

import pytest
import torch
from conftest import TINY_MODELS, make_config

from pagedllm import LLM, kernel_selection
from pagedllm import config as config_module
from pagedllm.attention import selector
from pagedllm.config import EngineConfig
from pagedllm.kernel_selection import resolve_kernel_choices
from pagedllm.layers.kernel_choices import TORCH_KERNELS
from pagedllm.models.spec import DecoderSpec


def tiny_spec(name: str = "llama_gqa_untied", **overrides) -> DecoderSpec:
    model_type, settings = TINY_MODELS[name]
    return DecoderSpec.from_hf_config(make_config(model_type, {**settings, **overrides}))


def fake_triton_installed(monkeypatch) -> None:
    monkeypatch.setattr(selector, "triton_installed", lambda: True)
    monkeypatch.setattr(kernel_selection, "triton_installed", lambda: True)


def test_cpu_defaults():
    """On CPU: float32 whatever the checkpoint holds, the model's positions, synchronous steps, the in-place C++
    attention (prompt chunks on SDPA's flash kernel), the layers' small ops and rotation in C++ and decode steps as
    one C++ call, the linear layers
    through oneDNN, plain torch otherwise."""
    resolved = EngineConfig(device="cpu").resolve(tiny_spec(), torch.bfloat16)
    assert resolved.device == torch.device("cpu")
    assert resolved.dtype == torch.float32
    assert resolved.max_model_len == 1024  # the tiny models' max_position_embeddings
    assert resolved.async_scheduling is False
    assert resolved.config.max_num_batched_tokens == 2048  # vLLM's CPU serving budget: activations under 32 MiB
    assert (
        resolved.kernels
        == dataclasses.replace(
            TORCH_KERNELS,
            attention="cpu",
            rotary="cpu",
            layer_ops="cpu",
            decode_steps="cpu",
            linear="cpu",
            torch_prompt_sdpa="flash",
        )
        and resolved.config.attention_backend == "cpu"
    )


def test_auto_device_on_a_machine_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    resolved = EngineConfig().resolve(tiny_spec(), None)
    assert (resolved.device, resolved.dtype, resolved.async_scheduling) == (torch.device("cpu"), torch.float32, False)


@pytest.mark.parametrize(
    ("checkpoint_dtype", "dtype"),
    [
        (torch.float16, torch.float16),
        ("bfloat16", torch.bfloat16),
        (torch.float32, torch.bfloat16),
        (None, torch.bfloat16),
    ],
)
def test_cuda_defaults(monkeypatch, checkpoint_dtype, dtype):
    """With a CUDA GPU (torch's answers faked: resolve makes no device call) and Triton: the checkpoint's 16-bit
    dtype, else bfloat16; overlapped steps; the Triton backend, the kernels resolve_kernel_choices picks."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    fake_triton_installed(monkeypatch)
    resolved = EngineConfig().resolve(tiny_spec(), checkpoint_dtype)
    assert (resolved.device, resolved.dtype) == (torch.device("cuda"), dtype)
    assert resolved.async_scheduling is True and resolved.config.attention_backend == "triton"
    assert resolved.config.max_num_batched_tokens == 8192
    assert resolved.kernels == resolve_kernel_choices(
        attention_backend=None, device=torch.device("cuda"), head_dim=tiny_spec().head_dim
    )
    assert resolved.kernels.attention == resolved.kernels.rotary == "triton"


def test_the_kernels_are_chosen_for_the_checkpoints_head_dim(monkeypatch):
    """A head_dim the Triton kernels cannot take (not a multiple of 8): torch attention, the other kernels kept; the
    asked-for backend stays in the config."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    fake_triton_installed(monkeypatch)
    spec = tiny_spec(head_dim=12)
    assert spec.head_dim == 12
    resolved = EngineConfig().resolve(spec, None)
    assert resolved.kernels.attention == "torch" and resolved.kernels.rotary == "triton"
    assert resolved.config.attention_backend == "triton"


def test_each_device_backend_needs_its_device(monkeypatch):
    """attention_backend='cpu' on a GPU, or 'triton' on the CPU: an error naming the device it needs."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=r"attention_backend='cpu' needs a CPU device, but device='cuda' is cuda"):
        EngineConfig(device="cuda", attention_backend="cpu")
    with pytest.raises(ValueError, match=r"attention_backend='triton' needs a CUDA device, but device='cpu' is cpu"):
        EngineConfig(device="cpu", attention_backend="triton")


def test_given_values_are_kept():
    config = EngineConfig(device="cpu", dtype="bf16", max_model_len=100, async_scheduling=True)
    resolved = config.resolve(tiny_spec(), torch.float16)
    assert (resolved.dtype, resolved.max_model_len, resolved.async_scheduling) == (torch.bfloat16, 100, True)
    assert (
        EngineConfig(device="cpu", max_num_batched_tokens=8192).resolve(tiny_spec(), None).config.max_num_batched_tokens
        == 8192
    )


def test_the_resolved_config_holds_the_resolved_values_and_the_other_settings_as_given():
    """What the executor and its ranks read: no default left to derive, every other field unchanged."""
    config = EngineConfig(device="cpu", block_size=8, kv_cache_dtype="fp8")
    resolved = config.resolve(tiny_spec(), None)
    concrete = {"device", "dtype", "max_model_len", "async_scheduling", "threads"}
    for field in dataclasses.fields(EngineConfig):
        expected = getattr(resolved, field.name) if field.name in concrete else getattr(config, field.name)
        if field.name == "attention_backend":
            expected = "cpu"  # None made concrete: the CPU's backend
        if field.name == "max_num_batched_tokens":
            expected = 2048  # None made concrete: the CPU's budget
        if field.name == "quantization":
            expected = None  # "auto" made concrete: this checkpoint's weights are not quantized
        assert getattr(resolved.config, field.name) == expected, field.name


def test_a_sliding_window_limits_max_model_len():
    spec = tiny_spec("mistral", sliding_window=256)
    assert EngineConfig(device="cpu").resolve(spec, None).max_model_len == 256
    with pytest.raises(ValueError, match="max_model_len=300 exceeds the model's limit of 256 positions"):
        EngineConfig(device="cpu", max_model_len=300).resolve(spec, None)


def test_the_thread_default_under_a_one_core_affinity_mask_is_one():
    script = (
        "import os; os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]}); "
        "from pagedllm.config import default_threads; print(default_threads())"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "(1, '1 core in its CPU affinity')"


def test_the_thread_default_leaves_one_core_for_other_work(monkeypatch):
    monkeypatch.setattr(config_module, "usable_cores", lambda: (4, "4 cores in its CPU affinity"))
    assert config_module.default_threads() == (3, "4 cores in its CPU affinity, one left for other work")


@pytest.mark.parametrize(
    "files, quota",
    [
        ({"cpu.max": "150000 100000\n"}, 1.5),
        ({"cpu.max": "max 100000\n"}, None),
        ({"cpu/cpu.cfs_quota_us": "200000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 2.0),
        ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
        ({}, None),
    ],
)
def test_a_cgroup_quota_caps_the_usable_cores(tmp_path, files, quota):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert config_module.cgroup_cpu_quota(tmp_path) == quota


def test_threads_are_checked_and_set(llama_dir):
    with pytest.raises(ValueError, match="threads must be a positive int or None, got 0"):
        EngineConfig(threads=0)
    before = torch.get_num_threads()
    try:
        llm = LLM(llama_dir, threads=1)
        assert torch.get_num_threads() == 1 and llm.llm_engine.resolved.threads_source == "asked for"
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ({"method": "ngram", "num_speculative_tokens": 3}, ("ngram", 3, 5, 5, None)),  # vLLM's lookup default
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 4}, ("ngram", 2, 4, 4, None)),
        ('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 3}',
         ("ngram", 4, 2, 3, None)),
        ({"method": "draft_model", "model": "/m", "num_speculative_tokens": 5}, ("draft_model", 5, 0, 0, "/m")),
    ],
)  # fmt: skip
def test_speculative_config_takes_vllms_keys_as_a_dict_or_json(value, expected):
    parsed = EngineConfig(speculative_config=value).speculative()
    assert (parsed.method, parsed.num_speculative_tokens, parsed.prompt_lookup_min, parsed.prompt_lookup_max,
            parsed.model) == expected  # fmt: skip


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("{method", "not valid JSON"),
        ({"method": "eagle", "num_speculative_tokens": 2}, "method must be one of"),
        ({"method": "ngram"}, "needs num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be a positive int"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
         "prompt_lookup_min=4 is above prompt_lookup_max=2"),
        ({"method": "ngram", "num_speculative_tokens": 2, "draft": 1}, "unknown key(s) ['draft']"),
        ({"method": "ngram", "num_speculative_tokens": 2, "model": "/m"}, "takes no model"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "needs model"),
    ],
)  # fmt: skip
def test_a_bad_speculative_config_says_what_is_wrong(value, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        EngineConfig(speculative_config=value)


def test_a_speculative_config_of_another_type_is_a_type_error():
    with pytest.raises(TypeError, match="a dict or its JSON text"):
        EngineConfig(speculative_config=[1])


def test_a_draft_model_is_refused_where_it_cannot_run_yet():
    draft = config_module.SpeculativeConfig.parse({"method": "draft_model", "model": "/m", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="tensor_parallel_size=1"):
        draft.check_engine(types.SimpleNamespace(tensor_parallel_size=2, device=torch.device("cpu")))
    draft.check_engine(types.SimpleNamespace(tensor_parallel_size=1, device=torch.device("cuda")))  # runs there


def test_disable_by_batch_size_defaults_to_a_small_batch_and_null_means_never():
    parse = config_module.SpeculativeConfig.parse
    assert parse({"method": "ngram", "num_speculative_tokens": 2}).disable_by_batch_size == 8
    assert (
        parse({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": None}).disable_by_batch_size
        is None
    )
    assert (
        parse('{"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 32}').disable_by_batch_size
        == 32
    )
