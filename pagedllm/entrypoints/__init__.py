"""Ways in for people: the `pagedllm` command line and the OpenAI-compatible server."""
