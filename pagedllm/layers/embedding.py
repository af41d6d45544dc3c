"""Token embedding and LM head with the vocabulary split across tensor-parallel ranks."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pagedllm.layers.linear import check_full_shape, copy_weight
from pagedllm.layers.parallel_state import all_reduce, tp_rank, tp_size


class VocabParallelEmbedding(nn.Module):
    """Rank r holds rows [r * shard, (r + 1) * shard) of the table; other ids embed to zero, then all-reduce."""

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.vocab_size = vocab_size
        self.shard_size = -(-vocab_size // tp_size())
        self.shard_start = tp_rank() * self.shard_size
        self.weight = nn.Parameter(torch.empty(self.shard_size, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        check_full_shape(loaded, (self.vocab_size, param.shape[1]))
        shard = loaded[self.shard_start : self.shard_start + self.shard_size]
        param.data.zero_()
        copy_weight(param[: shard.shape[0]], shard)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if tp_size() == 1:
            return F.embedding(input_ids, self.weight)
        local_ids = input_ids - self.shard_start
        in_shard = (local_ids >= 0) & (local_ids < self.shard_size)
        embedded = F.embedding(local_ids.clamp(0, self.shard_size - 1), self.weight)
        return all_reduce(embedded * in_shard.unsqueeze(-1).to(embedded.dtype))


class ParallelLMHead(VocabParallelEmbedding):
    """Logits over the vocabulary; every rank computes its shard and the full row is gathered on every rank."""

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden_states, self.weight)
        if tp_size() > 1:
            shards = [torch.empty_like(logits) for _ in range(tp_size())]
            dist.all_gather(shards, logits)
            logits = torch.cat(shards, dim=-1)
        return logits[:, : self.vocab_size]
