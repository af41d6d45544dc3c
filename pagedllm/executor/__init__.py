"""Tensors, devices and ranks: the Worker (StepPlan in, StepOutput out), its KV cache, step buffers and CUDA graphs."""
