"""Pure-Python scheduling: which sequences run each step, how many tokens each, and where their KV blocks are."""
