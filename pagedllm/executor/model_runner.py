"""ModelRunner: owns the model, its KV cache and the attention backend, and runs one scheduled step at a time."""

from __future__ import annotations

import numpy as np
import torch

from pagedllm.attention.selector import select_backend
from pagedllm.config import EngineConfig
from pagedllm.executor.cuda_graphs import DecodeGraphs, graph_batch_sizes, padded_batch_size
from pagedllm.executor.kv_cache import KVCache, allocate_kv_cache, bind_kv_cache, choose_num_kv_blocks, kv_block_bytes
from pagedllm.executor.step_inputs import StepBuffers, build_host_inputs, wrap_host_inputs
from pagedllm.layers.parallel_state import tp_size
from pagedllm.layers.sampler import SamplingTensors, sample
from pagedllm.loader.checkpoint import Checkpoint
from pagedllm.loader.weights import load_weights
from pagedllm.logger import logger
from pagedllm.models.registry import build_model
from pagedllm.models.spec import DecoderSpec
from pagedllm.sampling_params import SamplingParams
from pagedllm.scheduler.scheduler import ScheduledBatch
from pagedllm.scheduler.sequence import Sequence


def sampling_arrays(params: list[SamplingParams]) -> dict[str, np.ndarray]:
    """Per-row sampling settings as arrays; top_ps / top_ks only when some row uses them."""
    arrays = {"temperatures": np.array([p.temperature for p in params], dtype=np.float32)}
    if any(p.top_p < 1.0 for p in params):
        arrays["top_ps"] = np.array([p.top_p for p in params], dtype=np.float32)
    if any(p.top_k > 0 for p in params):
        arrays["top_ks"] = np.array([p.top_k for p in params], dtype=np.int64)
    return arrays


class SampledTokens:
    """One step's sampled token ids: on the device at once, on the host when token_ids() is called."""

    def __init__(self, device_tokens: torch.Tensor | None):
        self.device_tokens = device_tokens
        self.host_tokens = None
        if device_tokens is not None and device_tokens.is_cuda:
            self.host_tokens = torch.empty(device_tokens.shape, dtype=device_tokens.dtype, pin_memory=True)
            self.host_tokens.copy_(device_tokens, non_blocking=True)
            self.copied = torch.cuda.Event()
            self.copied.record()

    def token_ids(self) -> list[int]:
        if self.device_tokens is None:
            return []
        if self.host_tokens is None:
            return self.device_tokens.tolist()
        self.copied.synchronize()
        return self.host_tokens.tolist()


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        checkpoint: Checkpoint,
        spec: DecoderSpec,
        max_model_len: int,
        device: torch.device,
        dtype: torch.dtype,
    ):
        self.config, self.spec, self.device, self.dtype = config, spec, device, dtype
        self.block_size = config.block_size
        self.max_model_len = max_model_len
        # On CUDA every block table is as wide as max_model_len needs, so the graphs' buffers always fit.
        self.table_width = -(-max_model_len // config.block_size) if device.type == "cuda" else None
        self.buffers = None
        if device.type == "cuda":
            max_tokens = max(config.max_num_batched_tokens, config.max_num_seqs)
            self.buffers = StepBuffers(max_tokens, config.max_num_seqs, self.table_width, device)
        self.decode_batch_sizes = graph_batch_sizes(config.max_num_seqs)
        self.graphs: DecodeGraphs | None = None
        self.model = build_model(spec, max_model_len, dtype, device)
        load_weights(self.model, checkpoint.named_tensors(dtype), checkpoint.source)
        self.backend = select_backend(config.attention_backend, device, spec.head_dim, config.kv_cache_dtype)
        self.generators: dict[str, torch.Generator] = {}
        self.default_generator = torch.Generator(device=device).manual_seed(config.seed)
        block_bytes = kv_block_bytes(spec, config.block_size, dtype, tp_size(), config.kv_cache_dtype)
        self.num_kv_blocks = choose_num_kv_blocks(config, block_bytes, max_model_len, device, self.warmup)
        self.kv_cache = self.bind_kv_cache(self.num_kv_blocks)
        logger.info(
            "KV cache: %d blocks of %d tokens (%d tokens, %.2f GiB%s) on %s; attention backend %s",
            self.num_kv_blocks, config.block_size, self.num_kv_blocks * config.block_size,
            self.num_kv_blocks * block_bytes / 2**30, ", fp8" if config.kv_cache_dtype == "fp8" else "", device,
            self.backend.name,
        )  # fmt: skip
        if self.buffers is not None and not config.enforce_eager and self.backend.name == "triton":
            self.graphs = DecodeGraphs(self.model, self.buffers, config.max_num_seqs, max_model_len)
            self.graphs.capture()

    def bind_kv_cache(self, num_blocks: int) -> KVCache:
        kv_cache = allocate_kv_cache(
            self.spec, num_blocks, self.block_size, self.dtype, self.device, tp_size(), self.config.kv_cache_dtype
        )
        bind_kv_cache(self.model, kv_cache, self.backend)
        return kv_cache

    @torch.inference_mode()
    def warmup(self) -> None:
        """Run the largest prefill step and the largest decode step once, on a throwaway cache."""
        seq_len = min(self.max_model_len, self.config.max_num_batched_tokens)
        num_seqs = max(1, min(self.config.max_num_seqs, self.config.max_num_batched_tokens // seq_len))
        num_blocks = num_seqs * -(-seq_len // self.block_size)
        self.bind_kv_cache(num_blocks + self.config.max_num_seqs)
        params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50)
        prefill = [Sequence(f"warmup-{i}", [0] * seq_len, params) for i in range(num_seqs)]
        for seq_index, seq in enumerate(prefill):
            first = seq_index * -(-seq_len // self.block_size)
            seq.block_table = list(range(first, first + -(-seq_len // self.block_size)))
        self.execute(ScheduledBatch(prefill, [seq_len] * num_seqs))
        decode = [Sequence(f"warmup-d{i}", [0], params) for i in range(self.config.max_num_seqs)]
        for seq_index, seq in enumerate(decode):
            seq.block_table = [num_blocks + seq_index]
        self.execute(ScheduledBatch(decode, [1] * len(decode)))
        self.release_all()
        self.bind_kv_cache(0)  # drop the throwaway cache before free memory is measured

    def execute(self, batch: ScheduledBatch) -> list[int]:
        """Run one step; returns one sampled token id per sequence whose step reached its last token."""
        return self.launch(batch).token_ids()

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch, previous: SampledTokens | None = None) -> SampledTokens:
        """Queue one step on the device without waiting for it. Input tokens still unknown on the host
        (PLACEHOLDER, sampled by the step in flight) are taken on the device from `previous`."""
        num_seqs = len(batch.seqs)
        padded_size = None
        if self.buffers is not None and batch.num_tokens == num_seqs:
            # A CUDA decode step runs at a graph batch size, with graphs or without: the same matmul shapes make
            # graphs on and off give bit-identical results.
            padded_size = padded_batch_size(self.decode_batch_sizes, num_seqs)
        host = build_host_inputs(batch, self.block_size, self.table_width, pad_to=padded_size)
        seqs = [batch.seqs[index] for index in host.sampled_seq_indices]
        sampling = sampling_arrays([seq.sampling_params for seq in seqs])
        inputs = self.buffers.upload(host, sampling) if self.buffers is not None else wrap_host_inputs(host, sampling)
        if len(host.placeholder_rows):
            assert previous is not None and previous.device_tokens is not None, "placeholder without a step in flight"
            placeholders = previous.device_tokens.index_select(0, inputs.placeholder_sources)
            inputs.input_ids.index_copy_(0, inputs.placeholder_rows, placeholders)
        if padded_size is not None and self.graphs is not None:
            hidden = self.graphs.replay(padded_size)
        else:
            hidden = self.model(inputs.input_ids, inputs.positions, inputs.metadata)
        if not seqs:
            return SampledTokens(None)
        logits = self.model.compute_logits(hidden[inputs.sample_rows]).float()
        return SampledTokens(sample(logits, self.sampling_tensors(seqs, inputs.sampling)))

    def sampling_tensors(self, seqs: list[Sequence], sampling: dict[str, torch.Tensor]) -> SamplingTensors:
        temperatures = [seq.sampling_params.temperature for seq in seqs]
        return SamplingTensors(
            temperatures=sampling["temperatures"],
            top_ps=sampling.get("top_ps"),
            top_ks=sampling.get("top_ks"),
            generators=[self.generator_for(seq) for seq in seqs],
            default_generator=self.default_generator,
            all_greedy=all(t == 0 for t in temperatures),
            any_greedy=any(t == 0 for t in temperatures),
        )

    def generator_for(self, seq: Sequence) -> torch.Generator | None:
        seed = seq.sampling_params.seed
        if seed is None or seq.sampling_params.temperature == 0:
            return None
        if seq.request_id not in self.generators:
            self.generators[seq.request_id] = torch.Generator(device=self.device).manual_seed(seed)
        return self.generators[seq.request_id]

    def release(self, request_id: str) -> None:
        self.generators.pop(request_id, None)

    def release_all(self) -> None:
        self.generators.clear()
