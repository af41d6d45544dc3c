"""CUDA graphs for decode steps: one graph per padded batch size, all reading the same decode pack of StepBuffers.

A decode step of n sequences replays the graph of the smallest captured size >= n; the padding rows have
seq_len 0 and slot -1, so attention stores nothing for them and returns zeros. The block-table buffer is as
wide as max_model_len needs, so no sequence's table can outgrow what the graphs were captured with.
"""

from __future__ import annotations

import bisect

import torch
from torch import nn

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.executor.step_inputs import StepBuffers


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    sizes = [size for size in (1, 2, 4, 8) if size < max_num_seqs]
    sizes += list(range(16, max_num_seqs, 16))
    return sizes + [max_num_seqs]


def padded_batch_size(batch_sizes: list[int], num_seqs: int) -> int:
    """The smallest of the (sorted) captured sizes that holds num_seqs sequences."""
    return batch_sizes[bisect.bisect_left(batch_sizes, num_seqs)]


class DecodeGraphs:
    def __init__(self, model: nn.Module, buffers: StepBuffers, max_num_seqs: int, max_model_len: int):
        self.model, self.buffers, self.max_model_len = model, buffers, max_model_len
        self.batch_sizes = graph_batch_sizes(max_num_seqs)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        dtype = next(model.parameters()).dtype
        # [max_num_seqs, hidden_size]: every graph writes its output rows here
        device = buffers.decode.device_bytes.device
        self.hidden = torch.empty(max_num_seqs, model.spec.hidden_size, dtype=dtype, device=device)

    def decode_metadata(self, batch_size: int) -> AttentionMetadata:
        device = self.buffers.decode.device
        return AttentionMetadata(
            slot_mapping=device["slot_mapping"][:batch_size],
            query_start_loc=device["query_start_loc"][: batch_size + 1],
            seq_lens=device["seq_lens"][:batch_size],
            block_tables=device["block_tables"][:batch_size],
            max_query_len=1,
            max_seq_len=self.max_model_len,
            decode_only=True,
        )

    def forward(self, batch_size: int) -> torch.Tensor:
        metadata = self.decode_metadata(batch_size)
        device = self.buffers.decode.device
        input_ids, positions = device["input_ids"][:batch_size], device["positions"][:batch_size]
        return self.model(input_ids, positions, metadata)

    @torch.inference_mode()
    def capture(self) -> None:
        device = self.buffers.decode.device
        device["seq_lens"].zero_()  # every row is padding while capturing: nothing is read or stored
        device["slot_mapping"].fill_(-1)
        query_start_loc = device["query_start_loc"]
        query_start_loc.copy_(torch.arange(len(query_start_loc), dtype=torch.int32))
        pool = None
        for batch_size in reversed(self.batch_sizes):  # largest first, so smaller graphs reuse its memory
            self.forward(batch_size)  # warm-up: compiles kernels outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.hidden[:batch_size] = self.forward(batch_size)
            pool = graph.pool()
            self.graphs[batch_size] = graph
        for graph in self.graphs.values():
            graph.replay()  # a graph's first launch uploads it to the device: here, not in some request's step
        torch.cuda.synchronize()

    def replay(self, batch_size: int) -> torch.Tensor:
        self.graphs[batch_size].replay()
        return self.hidden[:batch_size]
