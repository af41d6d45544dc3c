"""Model architectures as layer wiring: one Llama-style decoder whose flags cover Llama, Mistral, Qwen2 and Qwen3."""
