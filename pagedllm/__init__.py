"""pagedllm: a small, readable, fast LLM inference engine with a vLLM-compatible offline API.

The names below are imported when first used (PEP 562), so `import pagedllm` and the command line's `--help` cost
no torch import; `from pagedllm import LLM` works as usual.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedllm.llm import LLM
    from pagedllm.outputs import CompletionOutput, RequestOutput
    from pagedllm.sampling.params import SamplingParams
    from pagedllm.structured_output import StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    """The public API's names, each imported from its module the first time it is asked for."""
    if name == "LLM":
        from pagedllm.llm import LLM

        return LLM
    if name in ("CompletionOutput", "RequestOutput"):
        from pagedllm import outputs

        return getattr(outputs, name)
    if name == "SamplingParams":
        from pagedllm.sampling.params import SamplingParams

        return SamplingParams
    if name == "StructuredOutputsParams":
        from pagedllm.structured_output import StructuredOutputsParams

        return StructuredOutputsParams
    raise AttributeError(f"module 'pagedllm' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
