"""Tensors, devices and ranks: the model runner, its KV cache, step inputs and CUDA graphs."""
