"""Layers take the kernel choices current while they are built (building_with_kernels) and keep them; the sampler
and its penalty state take theirs in the constructor. Nothing here runs a GPU kernel: the choices are read from the
built modules, and the compiled twins are replaced by recorders."""

from __future__ import annotations

import pytest
import torch

from pagedllm.layers.activation import SiluAndMul, silu_and_mul
from pagedllm.layers.kernel_choices import TORCH_KERNELS, KernelChoices, building_with_kernels, kernel_choices
from pagedllm.layers.linear import LinearBase
from pagedllm.layers.norm import RMSNorm, add_rms_norm, rms_norm
from pagedllm.layers.rotary import RotaryEmbedding, apply_rotary
from pagedllm.models.llama import SelfAttention
from pagedllm.models.registry import build_model
from pagedllm.models.spec import DecoderSpec
from pagedllm.sampling import sampler as sampler_module
from pagedllm.sampling import state as sampling_state
from pagedllm.sampling.batch import build_sampling_batch
from pagedllm.sampling.params import SamplingParams
from pagedllm.sampling.sampler import Sampler

SPEC = DecoderSpec(
    architecture="Qwen3ForCausalLM", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
    num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=1e4, rope_scaling=None,
    max_position_embeddings=128, tie_word_embeddings=True, qk_norm=True,
)  # fmt: skip
GPU_KERNELS = KernelChoices(
    attention="triton", rotary="triton", linear="skinny_gemm", sampler="triton_race", compile=True, pin_memory=True
)


def model(choices: KernelChoices | None) -> torch.nn.Module:
    if choices is None:
        return build_model(SPEC, 128, torch.float32, torch.device("cpu"))
    with building_with_kernels(choices):
        return build_model(SPEC, 128, torch.float32, torch.device("cpu"))


def kernels_of(built: torch.nn.Module) -> set[tuple[str, bool]]:
    """(kind of module, whether it runs the chosen GPU kernel) of every module that has a choice."""
    kinds = set()
    for module in built.modules():
        if isinstance(module, LinearBase):
            kinds.add(("linear", module.method.skinny_gemm is not None))
        elif isinstance(module, RMSNorm):
            compiled = (module.rms_norm, module.add_rms_norm) == (rms_norm.compiled, add_rms_norm.compiled)
            assert compiled or (module.rms_norm, module.add_rms_norm) == (rms_norm, add_rms_norm)
            kinds.add(("norm", compiled))
        elif isinstance(module, SiluAndMul):
            kinds.add(("silu", module.silu_and_mul is silu_and_mul.compiled))
        elif isinstance(module, RotaryEmbedding):
            kinds.add(("rotary compiled", module.apply_rotary is apply_rotary.compiled))
        elif isinstance(module, SelfAttention):
            kinds.add(("rotary in place", module.rotates_in_place))
    return kinds


KINDS = ("linear", "norm", "silu", "rotary compiled", "rotary in place")


def test_a_model_built_with_choices_keeps_them_and_the_next_one_gets_its_own():
    with_gpu_kernels = model(GPU_KERNELS)
    assert kernel_choices() is TORCH_KERNELS  # the block restored the choices around it
    plain = model(None)
    assert kernels_of(with_gpu_kernels) == {(kind, True) for kind in KINDS}
    assert kernels_of(plain) == {(kind, False) for kind in KINDS}
    assert kernels_of(with_gpu_kernels) == {(kind, True) for kind in KINDS}  # unchanged by the later build
    only_compile = kernels_of(model(KernelChoices(compile=True)))
    assert only_compile == {("linear", False), ("rotary in place", False)} | {
        (kind, True) for kind in ("norm", "silu", "rotary compiled")
    }


@pytest.fixture
def compiled_calls(monkeypatch) -> list[str]:
    """The names of the sampler's fusible functions whose compiled twin is called (each twin runs the function
    eagerly instead of compiling it)."""
    calls = []
    for module, name in ((sampler_module, "exponential_race"), (sampling_state, "penalise")):
        function = getattr(module, name)

        def recording(*args, function=function, name=name):
            calls.append(name)
            return function(*args)

        monkeypatch.setattr(function, "compiled", recording)
    return calls


def test_the_sampler_runs_what_its_choices_say(compiled_calls):
    params = [SamplingParams(temperature=0.7, presence_penalty=0.5, seed=1)] * 2  # seeded: never the fused race
    logits = torch.randn(2, 64, generator=torch.Generator().manual_seed(0))
    tokens = {}
    for choices in (TORCH_KERNELS, KernelChoices(compile=True)):
        sampler = Sampler(num_states=2, vocab_size=64, device=torch.device("cpu"), seed=0, kernels=choices)
        assert sampler.kernels is choices and sampler.penalties.kernels is choices
        for state_index, p in enumerate(params):
            sampler.add_request(state_index, p, prompt_token_ids=[1, 2])
        batch = build_sampling_batch(params, [0, 1], [0, 0])
        tokens[choices.compile] = sampler(logits.clone(), batch).sampled_token_ids.tolist()
        assert compiled_calls == ([] if not choices.compile else ["penalise", "exponential_race"])
    assert tokens[True] == tokens[False]  # the same functions, the same draws


def test_a_model_built_with_the_cpu_layer_ops_calls_them():
    """What they compute: tests/layers/test_cpu_layer_ops.py; the engine's tokens against transformers' with them:
    the CPU engine tests, which run them by default."""
    from pagedllm.layers import cpu_layer_ops

    built = model(KernelChoices(rotary="cpu", layer_ops="cpu"))
    for module in built.modules():
        if isinstance(module, RMSNorm):
            assert (module.rms_norm, module.add_rms_norm) == (cpu_layer_ops.rms_norm, cpu_layer_ops.add_rms_norm)
        elif isinstance(module, SiluAndMul):
            assert module.silu_and_mul is cpu_layer_ops.silu_and_mul
        elif isinstance(module, SelfAttention):
            assert module.rotates_in_place and module.rotary_kernel == "cpu"
