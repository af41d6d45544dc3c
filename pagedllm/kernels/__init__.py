"""Triton GPU kernels of the attention backend: paged KV store, varlen (prefill) attention, split-K decode."""

from pagedllm.kernels.decode_attention import decode_attention
from pagedllm.kernels.kv_store import store_kv_cache
from pagedllm.kernels.prefill_attention import prefill_attention

__all__ = ["decode_attention", "prefill_attention", "store_kv_cache"]
