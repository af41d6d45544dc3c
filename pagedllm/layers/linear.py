"""Linear layers split across tensor-parallel ranks, as in Megatron/vLLM.

Column-parallel layers split the output features (no communication); row-parallel layers split the input
features and all-reduce the partial sums. Each parameter carries a weight_loader that takes the checkpoint tensor
(a CheckpointTensor: nothing is read until it is narrowed to this rank's shard and copied) and narrows it to the
shard; the layer's linear method (layers/linear_method.py, chosen from the kernel choices) holds the weights, takes
the shard in and multiplies.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from pagedllm.layers.kernel_choices import KernelChoices, kernel_choices
from pagedllm.layers.linear_method import LinearMethod, UnquantizedLinearMethod
from pagedllm.layers.parallel_state import divide, kv_heads_per_rank, tp_group
from pagedllm.layers.quantization.fp8 import Fp8LinearMethod
from pagedllm.layers.quantization.gguf import GGUFLinearMethod

if TYPE_CHECKING:
    from pagedllm.loader.checkpoint_tensor import CheckpointTensor


def check_full_shape(loaded: CheckpointTensor, expected: tuple[int, ...]) -> None:
    """The whole checkpoint tensor must have the shape the config implies, checked before any rank narrows it
    (narrowing first would hide a tensor that is too large, and fail with a raw error on one too small)."""
    if tuple(loaded.shape) != tuple(expected):
        raise ValueError(f"checkpoint tensor has shape {tuple(loaded.shape)}, the config implies {tuple(expected)}")


def linear_method(choices: KernelChoices) -> LinearMethod:
    """The method a linear layer built under `choices` holds."""
    if choices.quantization == "gguf":
        return GGUFLinearMethod(choices.linear, float_prompts=choices.gguf_prompt_rows == "float")
    if choices.quantization is not None:
        return Fp8LinearMethod(scaling=choices.quantization.removeprefix("fp8_"))
    return UnquantizedLinearMethod(choices.linear)


class LinearBase(nn.Module):
    """Holds its tensor-parallel group and its linear method, both taken while the model is built."""

    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__()
        self.tp = tp_group()
        self.method = linear_method(kernel_choices())
        self.method.create_weights(self, in_features, out_features, bias)
        for param in self.parameters(recurse=False):
            param.weight_loader = self.weight_loader

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x, self.bias)


class ColumnParallelLinear(LinearBase):
    """y = x W^T with W's rows (output features) split across ranks; each rank returns its slice of y."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__(in_features, divide(out_features, tp_group().size, "output features"), bias)

    def weight_loader(self, param: nn.Parameter, loaded: CheckpointTensor) -> None:
        shard = param.shape[0]
        check_full_shape(loaded, (shard * self.tp.size, *param.shape[1:]))
        self.method.load(param, loaded.narrow(0, self.tp.rank * shard, shard))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matmul (gate and up): each rank holds [gate_shard; up_shard]."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False):
        self.output_sizes = output_sizes
        super().__init__(in_features, sum(output_sizes), bias)

    def weight_loader(self, param: nn.Parameter, loaded: CheckpointTensor, shard_id: int) -> None:
        size = self.output_sizes[shard_id] // self.tp.size
        offset = sum(self.output_sizes[:shard_id]) // self.tp.size
        check_full_shape(loaded, (self.output_sizes[shard_id], *param.shape[1:]))
        self.method.load(param.narrow(0, offset, size), loaded.narrow(0, self.tp.rank * size, size))


class QKVParallelLinear(LinearBase):
    """q, k and v projections in one column-parallel matmul; each rank holds its heads: [q heads; k heads; v heads].

    With more ranks than KV heads, each KV head is replicated: the ranks r with the same r // kv_replicas share one.
    """

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False):
        size = tp_group().size
        self.head_dim, self.total_num_heads, self.total_num_kv_heads = head_dim, num_heads, num_kv_heads
        self.num_heads = divide(num_heads, size, "num_attention_heads")
        self.num_kv_heads = kv_heads_per_rank(num_kv_heads, size)
        self.kv_replicas = max(1, size // num_kv_heads)
        super().__init__(hidden_size, (self.num_heads + 2 * self.num_kv_heads) * head_dim, bias)

    def weight_loader(self, param: nn.Parameter, loaded: CheckpointTensor, shard_id: str) -> None:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        kv_index = self.tp.rank // self.kv_replicas
        offset, size, index = {
            "q": (0, q_size, self.tp.rank),
            "k": (q_size, kv_size, kv_index),
            "v": (q_size + kv_size, kv_size, kv_index),
        }[shard_id]
        total_heads = self.total_num_heads if shard_id == "q" else self.total_num_kv_heads
        check_full_shape(loaded, (total_heads * self.head_dim, *param.shape[1:]))
        self.method.load(param.narrow(0, offset, size), loaded.narrow(0, index * size, size))


class RowParallelLinear(LinearBase):
    """y = x W^T with W's columns (input features) split: each rank multiplies its slice, then all-reduce."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__(divide(in_features, tp_group().size, "input features"), out_features, bias)

    def weight_loader(self, param: nn.Parameter, loaded: CheckpointTensor) -> None:
        if param.dim() == 1:  # bias: added once, after the reduction
            self.method.load(param, loaded)
            return
        shard = param.shape[1]
        check_full_shape(loaded, (param.shape[0], shard * self.tp.size))
        self.method.load(param, loaded.narrow(1, self.tp.rank * shard, shard))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(self.method.apply(self, x, None))
        return y if self.bias is None else y + self.bias
