"""Token embedding and LM head with the vocabulary split across tensor-parallel ranks.

The vocabulary is padded to a multiple of the TP size (as vLLM does), so any vocabulary size splits evenly:
rank r holds rows [r * shard_size, (r + 1) * shard_size); rows past the real vocabulary are zero. On one rank with
GGUF weights kept quantized, the vocabulary stays in its blocks where their format is kept (GGUFVocabMethod).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.layers.kernel_choices import kernel_choices
from pagedllm.layers.linear import check_full_shape
from pagedllm.layers.linear_method import UnquantizedLinearMethod
from pagedllm.layers.parallel_state import tp_group
from pagedllm.layers.quantization.gguf import GGUFVocabMethod
from pagedllm.loader.checkpoint_tensor import CheckpointTensor, copy_weight


class VocabParallelEmbedding(nn.Module):
    """Each rank embeds the ids in its shard and zero for the others; the all-reduce sums the one non-zero row."""

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.tp = tp_group()
        self.vocab_size = vocab_size
        self.shard_size = -(-vocab_size // self.tp.size)
        self.shard_start = self.tp.rank * self.shard_size
        self.weight = nn.Parameter(torch.empty(self.shard_size, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        gguf = kernel_choices().quantization == "gguf" and self.tp.size == 1
        self.method = GGUFVocabMethod() if gguf else None  # a tied head takes its embedding's (models/llama.py)

    def weight_loader(self, param: nn.Parameter, loaded: CheckpointTensor) -> None:
        check_full_shape(loaded, (self.vocab_size, param.shape[1]))
        if self.method is not None and self.method.load(param, loaded):
            return
        start = min(self.shard_start, self.vocab_size)
        rows = min(self.shard_size, self.vocab_size - start)  # the last rank's shard ends in padding
        param.data.zero_()
        copy_weight(param[:rows], loaded.narrow(0, start, rows))

    @property
    def quantized(self) -> bool:
        return self.method is not None and self.method.quantized

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.quantized:
            return self.method.embed(input_ids, self.weight.dtype)
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local_ids = input_ids - self.shard_start
        in_shard = (local_ids >= 0) & (local_ids < self.shard_size)
        embedded = F.embedding(local_ids.clamp(0, self.shard_size - 1), self.weight)
        return self.tp.all_reduce(embedded * in_shard.unsqueeze(-1).to(embedded.dtype))


class ParallelLMHead(VocabParallelEmbedding):
    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__(vocab_size, hidden_size)
        # Float weights on CPU as the linear layers' (float32 panels, else oneDNN: the default model's float32 head
        # took 5.7 ms a row through oneDNN against aten::mm's 8.7); F.linear on CUDA (the one-row GEMV took
        # Qwen3-0.6B's head in 73 us against cuBLAS's 80 alone, not yet measured in the engine).
        choice = kernel_choices().linear
        linear = UnquantizedLinearMethod(choice if choice in ("onednn", "cpu") else "torch")
        self.product = linear.product
        self.tied = False
        self.prepared_weight: torch.Tensor | None = None  # a tied float head's weight in its product's layout
        if choice in ("onednn", "cpu") and self.method is None:
            self.method = PreparedHeadMethod(linear)

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        """Share the embedding's weight (and its method, where it has one: GGUF blocks)."""
        self.weight, self.tied = embedding.weight, True
        if embedding.method is not None:
            self.method = embedding.method

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """Logits over the vocabulary on rank 0 (padding dropped); None on the other ranks, which only send their
        shard."""
        if self.quantized:
            return self.method.logits(hidden_states)[:, : self.vocab_size]  # one rank: nothing to gather
        weight = self.weight if self.prepared_weight is None else self.prepared_weight
        logits = self.tp.gather_last_dim_to_first(self.product(hidden_states, weight))
        return None if logits is None else logits[:, : self.vocab_size]


class PreparedHeadMethod:
    """A float head's weight prepared once, when loaded, in the layout its product runs fastest on (float32 panels or
    oneDNN's blocked layout), as the linear layers' are. A tied head keeps the prepared copy beside the weight (the
    embedding reads the plain rows), so it costs the vocabulary's bytes once more; without it oneDNN reordered the
    weight on every call: the default model's float32 head took 8.5 ms a step at one row and 18.7 at six (a verify
    step) in the engine, against 5.7 and 7.4 (benchmarks/NOTES.md, session 30)."""

    quantized = False

    def __init__(self, linear: UnquantizedLinearMethod):
        self.linear = linear  # the head's product (ParallelLMHead.product)

    def load(self, param: torch.Tensor, loaded: CheckpointTensor) -> bool:
        return False  # the weight loads as any float weight

    def finish_loading(self, head: ParallelLMHead) -> None:
        if not head.tied:
            self.linear.finish_loading(head)  # prepared in place, as a linear layer's weight
        else:
            head.prepared_weight = self.linear.prepared(head.weight.data)
