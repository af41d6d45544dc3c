"""GrammarCompiler: compiles on its worker thread (submit never waits for a compile), hands the same grammar to the
same constraint, and surfaces a bad constraint as the backend's ValueError."""

from __future__ import annotations

import threading

import pytest
from conftest import VOCAB_SIZE, train_tokenizer

from pagedllm import StructuredOutputsParams
from pagedllm.structured_output.backend import CompiledGrammar, StructuredOutputBackend
from pagedllm.structured_output.compiler import GrammarCompiler


class BlockingBackend(StructuredOutputBackend):
    """Compiles only once released; records the thread each compile ran on."""

    vocab_size = 64

    def __init__(self):
        self.release = threading.Event()
        self.threads: list[str] = []

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        self.threads.append(threading.current_thread().name)
        if not self.release.wait(timeout=30):
            raise TimeoutError("never released")
        if params.kind == "regex" and params.regex == "bad":
            raise ValueError("structured_outputs.regex cannot be compiled: bad")
        return object()


@pytest.fixture
def compiler():
    backend = BlockingBackend()
    compiler = GrammarCompiler(backend, max_cached=2)
    yield compiler
    backend.release.set()
    compiler.shutdown()


def test_submit_returns_before_the_compile_ends(compiler):
    future = compiler.submit(StructuredOutputsParams(regex="a+"))
    assert not future.done()  # the compile waits on release: submit did not
    compiler.backend.release.set()
    assert isinstance(future.result(timeout=30), object)
    assert compiler.backend.threads == ["pagedllm-grammar_0"]


def test_the_same_constraint_gets_the_same_grammar(compiler):
    compiler.backend.release.set()
    first = compiler.submit(StructuredOutputsParams(json={"type": "integer", "minimum": 0}))
    again = compiler.submit(StructuredOutputsParams(json='{"minimum": 0, "type": "integer"}'))
    other = compiler.submit(StructuredOutputsParams(json={"type": "integer"}))
    assert again is first and first.result(timeout=30) is again.result(timeout=30)
    assert other.result(timeout=30) is not first.result()
    assert len(compiler.backend.threads) == 2


def test_least_recently_submitted_is_dropped_past_max_cached(compiler):
    compiler.backend.release.set()
    a, b, c = (StructuredOutputsParams(regex=regex) for regex in "abc")
    first_a, first_b = compiler.submit(a), compiler.submit(b)
    assert compiler.submit(a) is first_a  # a is now the most recent
    first_c = compiler.submit(c)  # drops b
    assert compiler.submit(a) is first_a and compiler.submit(c) is first_c
    again_b = compiler.submit(b)  # compiled again; drops a
    assert again_b is not first_b
    for future in (first_a, first_b, first_c, again_b):
        future.result(timeout=30)
    assert len(compiler.backend.threads) == 4


def test_a_bad_constraint_raises_value_error_from_its_future(compiler):
    compiler.backend.release.set()
    future = compiler.submit(StructuredOutputsParams(regex="bad"))
    with pytest.raises(ValueError, match="structured_outputs.regex cannot be compiled"):
        future.result(timeout=30)
    assert compiler.submit(StructuredOutputsParams(regex="bad")) is future


def test_llguidance_compiles_a_large_schema_on_the_worker():
    pytest.importorskip("llguidance", reason="needs the structured extra")
    from pagedllm.structured_output.factory import load_backend

    backend = load_backend(train_tokenizer(), VOCAB_SIZE, [1])
    compiler = GrammarCompiler(backend)
    properties = {
        f"field_{index}": {"type": "string", "pattern": f"[a-z]{{{index % 7 + 1}}}[0-9]+"} for index in range(300)
    }
    schema = {"type": "object", "properties": properties, "required": list(properties)}
    try:
        future = compiler.submit(StructuredOutputsParams(json=schema))
        grammar = future.result(timeout=120)
        assert compiler.submit(StructuredOutputsParams(json=schema)).result() is grammar
        assert grammar.matcher().accept_token(train_tokenizer().convert_tokens_to_ids("{"))
        bad = compiler.submit(StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "nope"}}}))
        with pytest.raises(ValueError, match="structured_outputs.json"):
            bad.result(timeout=30)
    finally:
        compiler.shutdown()
