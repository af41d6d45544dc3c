"""The OpenAI-compatible server (`pagedllm serve`) and the engine behind it: AsyncLLM, and the core loop that steps
the engine in its own process. Needs the `serve` extra: pip install 'pagedllm[serve]'."""
