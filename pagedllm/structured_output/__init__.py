"""Structured output: constrain a sample's tokens to a JSON schema, a regex, a choice of strings or a grammar.

The parameters are plain data (`params`); compiling and matching is a backend's job (the interface `backend`, the
implementation `llguidance_backend`, chosen by `factory`), off the step path (`compiler`); the mask meets the logits
on the device (`bitmask`).
"""

from pagedllm.structured_output.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
