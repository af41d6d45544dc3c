"""The OpenAI-compatible server (`pagedllm serve`); needs the `serve` extra: pip install 'pagedllm[serve]'."""
