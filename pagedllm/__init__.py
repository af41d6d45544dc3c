"""pagedllm: a small, readable, fast LLM inference engine with a vLLM-compatible offline API."""

from pagedllm.llm import LLM
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.sampling.params import SamplingParams
from pagedllm.structured_output import StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
