"""Ways in for people: the `pagedllm` command line."""
