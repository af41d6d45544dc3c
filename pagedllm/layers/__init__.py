"""Building blocks of the decoder, tensor-parallel-aware: linear, embedding/head, norm, rotary, activation, sampler."""
