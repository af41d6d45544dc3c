"""CUDA graphs: a step replays the whole model forward as one graph instead of launching its kernels one by one.

Decode steps: one graph per padded batch size, all reading the decode pack of StepBuffers. A decode step of n
sequences replays the graph of the smallest captured size >= n; the padding rows have seq_len 0 and slot -1, so
attention stores nothing for them and returns zeros.

Every other step (prompt chunks, alone or beside decodes): one graph per padded token count, reading the any-step
pack with max_num_seqs sequence rows. Launched op by op, such a step cost the host about as long as the device took
for it (~27 ms against ~30 ms for 8,000 tokens of Qwen3-0.6B on the H200), so it ran at the host's pace. The padding
tokens belong to no sequence and have slot -1; the padding sequences are empty (query_start_loc repeats its last
value), so the prefill kernel's programs for them return at once. Steps above MAX_GRAPH_TOKENS run eagerly.

The block-table buffers are as wide as max_model_len needs, so no sequence's table can outgrow what the graphs
were captured with.
"""

from __future__ import annotations

import bisect

import torch
from torch import nn

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.executor.step_inputs import PackedInputs, StepBuffers


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    sizes = [size for size in (1, 2, 4, 8) if size < max_num_seqs]
    sizes += list(range(16, max_num_seqs, 16))
    return sizes + [max_num_seqs]


# Steps of more tokens run eagerly: their device time (~4 us a token for Qwen3-0.6B on the H200) outgrows the ~27 ms
# their launch costs the host, and a graph would hold that many tokens' activations for good.
MAX_GRAPH_TOKENS = 8192


def graph_token_counts(max_tokens: int) -> list[int]:
    """Token counts of the prefill graphs: doubling up to 2048 (a short prompt's step pads to at most twice its
    tokens, cheap next to launching it op by op), then every 1024 (at most 1023 padding tokens on a long step), up to
    the token budget or MAX_GRAPH_TOKENS."""
    largest = min(max_tokens, MAX_GRAPH_TOKENS)
    counts = [count for count in (16, 32, 64, 128, 256, 512, 1024, 2048) if count < largest]
    counts += list(range(3072, largest, 1024))
    return counts + [largest]


def padded_batch_size(batch_sizes: list[int], num_seqs: int) -> int:
    """The smallest of the (sorted) captured sizes that holds num_seqs sequences (or tokens)."""
    return batch_sizes[bisect.bisect_left(batch_sizes, num_seqs)]


class StepGraphs:
    """One graph per size, each writing its rows of `hidden`. Subclasses say which pack a size reads and how."""

    tokens_per_padding_seq: int  # in the padding rows the graphs are captured on

    def __init__(self, model: nn.Module, pack: PackedInputs, sizes: list[int], max_rows: int):
        self.model, self.pack, self.sizes = model, pack, sizes
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        dtype = next(model.parameters()).dtype
        device = pack.device_bytes.device
        self.hidden = torch.empty(max_rows, model.spec.hidden_size, dtype=dtype, device=device)

    def metadata(self, size: int) -> AttentionMetadata:
        raise NotImplementedError

    def forward(self, size: int) -> torch.Tensor:
        device = self.pack.device
        return self.model(device["input_ids"][:size], device["positions"][:size], self.metadata(size))

    def empty_inputs(self) -> None:
        """Every row padding while capturing (each array's pad value: seq_len 0, slot -1): nothing is read or
        stored."""
        self.pack.fill_padding(self.tokens_per_padding_seq)

    def capture(self, pool=None):
        """Capture every size, largest first so that smaller graphs reuse its memory; returns the memory pool, which
        other graphs may share (steps replay one at a time on one stream)."""
        self.empty_inputs()
        for size in reversed(self.sizes):
            self.forward(size)  # warm-up: compiles kernels outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.hidden[:size] = self.forward(size)
            pool = graph.pool()
            self.graphs[size] = graph
        for graph in self.graphs.values():
            graph.replay()  # a graph's first launch uploads it to the device: here, not in some request's step
        torch.cuda.synchronize()
        return pool

    def replay(self, size: int) -> torch.Tensor:
        self.graphs[size].replay()
        return self.hidden[:size]


class DecodeGraphs(StepGraphs):
    """Decode steps, by padded batch size (one token per sequence)."""

    tokens_per_padding_seq = 1

    def __init__(self, model: nn.Module, buffers: StepBuffers, max_num_seqs: int, max_model_len: int):
        super().__init__(model, buffers.decode, graph_batch_sizes(max_num_seqs), max_num_seqs)
        self.max_model_len = max_model_len

    def metadata(self, batch_size: int) -> AttentionMetadata:
        device = self.pack.device
        return AttentionMetadata(
            slot_mapping=device["slot_mapping"][:batch_size],
            query_start_loc=device["query_start_loc"][: batch_size + 1],
            seq_lens=device["seq_lens"][:batch_size],
            block_tables=device["block_tables"][:batch_size],
            max_query_len=1,
            max_seq_len=self.max_model_len,
            decode_only=True,
        )


class PrefillGraphs(StepGraphs):
    """Every other step, by padded token count, always with max_num_seqs sequence rows (pad_prefill_plan)."""

    tokens_per_padding_seq = 0  # every sequence empty

    def __init__(
        self, model: nn.Module, buffers: StepBuffers, token_counts: list[int], max_num_seqs: int, max_model_len: int
    ):
        super().__init__(model, buffers.any_step, token_counts, token_counts[-1])
        self.max_num_seqs, self.max_model_len = max_num_seqs, max_model_len

    def metadata(self, num_tokens: int) -> AttentionMetadata:
        device = self.pack.device
        return AttentionMetadata(
            slot_mapping=device["slot_mapping"][:num_tokens],
            query_start_loc=device["query_start_loc"][: self.max_num_seqs + 1],
            seq_lens=device["seq_lens"][: self.max_num_seqs],
            block_tables=device["block_tables"][: self.max_num_seqs],
            max_query_len=num_tokens,
            max_seq_len=self.max_model_len,
            decode_only=False,
        )
