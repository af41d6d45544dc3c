"""Triton GPU kernels: the attention backend's paged KV store, varlen (prefill) attention and split-K decode; the
sampler's exponential race in one pass (on by default; PAGEDLLM_FUSED_SAMPLER=0 turns it off)."""

from pagedllm.kernels.decode_attention import decode_attention
from pagedllm.kernels.kv_store import store_kv_cache
from pagedllm.kernels.prefill_attention import prefill_attention
from pagedllm.kernels.race_sampling import race_sample

__all__ = ["decode_attention", "prefill_attention", "race_sample", "store_kv_cache"]
