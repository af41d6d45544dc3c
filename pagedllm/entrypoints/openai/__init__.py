"""The OpenAI-compatible server (`pagedllm serve`) and the engine behind it: AsyncLLM, and the core loop that steps
the engine in its own process. Needs the `serve` extra: pip install 'pagedllm[serve]'."""

SERVE_EXTRA = "pip install 'pagedllm[serve]'"


def serve_extra_missing(what: str, error: ModuleNotFoundError) -> ImportError:
    """The one-line error for a module of the serve extra that is not installed (raised `from None`)."""
    return ImportError(f"{what} needs the serve extra, and {error.name!r} is not installed: {SERVE_EXTRA}")
