"""CUDA graphs for decode steps: one graph per padded batch size, all reading the same StepBuffers.

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
        device = buffers.input_ids.device.device
        self.hidden = torch.empty(max_num_seqs, model.spec.hidden_size, dtype=dtype, device=device)

    def decode_metadata(self, batch_size: int) -> AttentionMetadata:
        buffers = self.buffers
        return AttentionMetadata(
            slot_mapping=buffers.slot_mapping.device[:batch_size],
            query_start_loc=buffers.query_start_loc.device[: batch_size + 1],
            seq_lens=buffers.seq_lens.device[:batch_size],
            block_tables=buffers.block_tables.device[:batch_size],
            max_query_len=1,
            max_seq_len=self.max_model_len,
            decode_only=True,
        )

    def forward(self, batch_size: int) -> torch.Tensor:
        metadata = self.decode_metadata(batch_size)
        input_ids, positions = self.buffers.input_ids.device[:batch_size], self.buffers.positions.device[:batch_size]
        return self.model(input_ids, positions, metadata)

    @torch.inference_mode()
    def capture(self) -> None:
        buffers = self.buffers
        buffers.seq_lens.device.zero_()  # every row is padding while capturing: nothing is read or stored
        buffers.slot_mapping.device.fill_(-1)
        query_start_loc = buffers.query_start_loc.device
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
