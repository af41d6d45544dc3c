"""GrammarCompiler: compiles constraints on a worker thread, off the step path, and keeps what it compiled.

The engine submits a request's params and polls the future each step (`future.done()` never blocks); a constraint
seen before returns the same future, and so the same CompiledGrammar, at once.
"""

from __future__ import annotations

from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

from pagedllm.structured_output.backend import CompiledGrammar, StructuredOutputBackend
from pagedllm.structured_output.params import StructuredOutputsParams

MAX_CACHED_GRAMMARS = 256


class GrammarCompiler:
    """submit() is called from one thread (the engine's). A failed compile is kept too: its future raises the
    backend's ValueError, again at once for the same constraint."""

    def __init__(self, backend: StructuredOutputBackend, max_cached: int = MAX_CACHED_GRAMMARS):
        self.backend = backend
        self.max_cached = max_cached
        # One thread: compiles run in submission order, and llguidance releases the GIL while it builds a grammar.
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedllm-grammar")
        self.cache: OrderedDict[tuple, Future[CompiledGrammar]] = OrderedDict()  # least recently submitted first

    def submit(self, params: StructuredOutputsParams) -> Future[CompiledGrammar]:
        key = params.cache_key
        future = self.cache.get(key)
        if future is not None:
            self.cache.move_to_end(key)
            return future
        future = self.executor.submit(self.backend.compile, params)
        self.cache[key] = future
        if len(self.cache) > self.max_cached:
            self.cache.popitem(last=False)  # a request holding that future keeps it; a later one compiles again
        return future

    def shutdown(self) -> None:
        """Stop the worker; compiles not yet started are cancelled."""
        self.executor.shutdown(wait=False, cancel_futures=True)
