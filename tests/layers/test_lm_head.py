"""The float LM head on CPU: its weight prepared once when loaded (oneDNN's layout, or float32 panels for the C++
product), a tied head's into a copy of its own (the embedding keeps reading the plain rows), with the logits of the
product on the plain weight."""

from __future__ import annotations

import pytest
import torch
from conftest import local_worker

from pagedllm import LLM, SamplingParams, cpu_kernels
from pagedllm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedllm.layers.kernel_choices import KernelChoices, building_with_kernels
from pagedllm.loader.checkpoint_tensor import CheckpointTensor

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN")
VOCAB, HIDDEN = 304, 64  # whole panels of 16 rows


def loaded_head(tied: bool, linear: str) -> tuple[ParallelLMHead, VocabParallelEmbedding, torch.Tensor]:
    """A head (and its embedding) loaded from one random matrix as the loader does: weight_loader, then the
    method's finish_loading."""
    weight = torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(0))
    with building_with_kernels(KernelChoices(linear=linear)):
        embedding, head = VocabParallelEmbedding(VOCAB, HIDDEN), ParallelLMHead(VOCAB, HIDDEN)
    checkpoint = CheckpointTensor.lazy("w", tuple(weight.shape), weight.__getitem__, torch.float32)
    embedding.weight_loader(embedding.weight, checkpoint)
    if tied:
        head.tie_to(embedding)
    else:
        head.weight_loader(head.weight, checkpoint)
    head.method.finish_loading(head)
    return head, embedding, weight


@pytest.mark.parametrize("linear", ["onednn", "cpu"])
@pytest.mark.parametrize("tied", [True, False])
def test_the_head_is_prepared_once_and_multiplies_as_before(tied, linear):
    if linear == "cpu" and cpu_kernels.unavailable_reason() is not None:
        pytest.skip("the CPU kernels do not build here")
    head, embedding, weight = loaded_head(tied, linear)
    hidden = torch.randn(6, HIDDEN)
    # before: oneDNN reordered the plain weight on every call; the panels' product takes the same order of sums
    per_call = torch.ops.mkldnn._linear_pointwise(hidden, weight, None, "none", [], "")
    torch.testing.assert_close(head.compute_logits(hidden), per_call, rtol=1e-6, atol=1e-6)
    if linear == "onednn":
        assert torch.equal(head.compute_logits(hidden), per_call)
    torch.testing.assert_close(per_call, hidden @ weight.t(), rtol=1e-5, atol=1e-5)
    prepared = head.prepared_weight if tied else head.weight
    assert prepared.dim() == (3 if linear == "cpu" else 2)  # panels [vocab / 16, hidden, 16]
    if tied:
        assert head.weight is embedding.weight
        ids = torch.tensor([0, 7, 299])
        assert torch.equal(embedding(ids), weight[ids])  # the embedding still reads plain rows
    else:
        assert head.prepared_weight is None  # prepared in place: no second copy


def test_an_engine_with_a_tied_float_head_loads_it_prepared(tiny_model_dirs):
    llm = LLM(tiny_model_dirs["qwen3"], device="cpu", dtype="float32", max_model_len=64)
    head = local_worker(llm).model.lm_head
    if local_worker(llm).kernels.linear not in ("onednn", "cpu"):
        pytest.skip("oneDNN linear is off here")
    assert head.tied and head.prepared_weight is not None
    out = llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
