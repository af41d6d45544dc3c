"""The llguidance backend on the default model's tokenizer and on the tiny one (no EOS, a vocabulary padded past the
tokenizer): the logits left finite by apply_bitmask are exactly the matcher's mask, every token in it is accepted,
random walks through the mask end in
text that satisfies the constraint, rollback and reset return to the same masks, and bad constraints are ValueErrors
naming the field and the problem."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import numpy as np
import pytest
import torch
from conftest import VOCAB_SIZE, train_tokenizer

pytest.importorskip("llguidance", reason="the structured-output tests need the structured extra")

from pagedllm import StructuredOutputsParams  # noqa: E402
from pagedllm.structured_output.bitmask import apply_bitmask  # noqa: E402
from pagedllm.structured_output.factory import load_backend  # noqa: E402

PADDED_VOCAB_SIZE = VOCAB_SIZE + 40  # a model vocabulary past the tokenizer's, as real models pad theirs

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
PET_REGEX = r"(cat|dog)-[0-9]{1,3}(\.[a-z]{2})?"
CHOICES = ["yes", "no", 'say "hi"\\', "Zürich", "tab\there", "a", "ab", "new\nline"]
LARK = 'start: greeting " " name\ngreeting: "hello" | "hi"\nname: /[A-Z][a-z]{1,5}/'
GBNF = 'root ::= "n=" digit digit?\ndigit ::= [0-9]'


def satisfies_json(schema):
    def check(text: str) -> bool:
        try:
            jsonschema.validate(json.loads(text), schema)
        except (json.JSONDecodeError, jsonschema.ValidationError):
            return False
        return True

    return check


def fullmatch(pattern: str):
    return lambda text: re.fullmatch(pattern, text) is not None


# (params, a check that the finished text satisfies the constraint); every constraint here is bounded, so a walk
# through its masks always ends.
CONSTRAINTS = {
    "json": (StructuredOutputsParams(json=PERSON, whitespace_pattern="[ ]?"), satisfies_json(PERSON)),
    "json-text": (
        StructuredOutputsParams(json=json.dumps({"type": "array", "items": {"type": "boolean"}, "maxItems": 2})),
        satisfies_json({"type": "array", "items": {"type": "boolean"}, "maxItems": 2}),
    ),
    "regex": (StructuredOutputsParams(regex=PET_REGEX), fullmatch(PET_REGEX)),
    "choice": (StructuredOutputsParams(choice=CHOICES), lambda text: text in CHOICES),
    "lark": (StructuredOutputsParams(grammar=LARK), fullmatch(r"(hello|hi) [A-Z][a-z]{1,5}")),
    "gbnf": (StructuredOutputsParams(grammar=GBNF), fullmatch(r"n=[0-9]{1,2}")),
}


@pytest.fixture(scope="module")
def default_backend(default_checkpoint):
    tokenizer = default_checkpoint.tokenizer
    return load_backend(tokenizer, default_checkpoint.hf_config.vocab_size, [tokenizer.eos_token_id])


@pytest.fixture(scope="module")
def tiny_tokenizer():
    return train_tokenizer()


@pytest.fixture(scope="module")
def tiny_backend(tiny_tokenizer):
    """No EOS, as the tiny test models: a stand-in end token is cleared from every mask."""
    return load_backend(tiny_tokenizer, PADDED_VOCAB_SIZE, [])


@pytest.fixture(scope="module", params=["default", "tiny"])
def setup(request):
    """(backend, tokenizer, model vocabulary size)."""
    if request.param == "default":
        checkpoint = request.getfixturevalue("default_checkpoint")
        backend = request.getfixturevalue("default_backend")
        return backend, checkpoint.tokenizer, checkpoint.hf_config.vocab_size
    return request.getfixturevalue("tiny_backend"), request.getfixturevalue("tiny_tokenizer"), PADDED_VOCAB_SIZE


def mask_of(backend, matcher) -> np.ndarray:
    row = np.zeros(backend.bitmask_words, dtype=np.int32)
    matcher.fill_bitmask(row)
    return row


def allowed_by_mask(backend, matcher, vocab_size: int) -> set[int]:
    """The token ids whose logits stay finite after apply_bitmask, in row 1 of three."""
    logits = torch.randn(3, vocab_size)
    bitmask = torch.from_numpy(mask_of(backend, matcher)[None])
    apply_bitmask(logits, bitmask, torch.tensor([1]))
    return set(torch.isfinite(logits[1]).nonzero().flatten().tolist())


def allowed_by_bits(row: np.ndarray, vocab_size: int) -> set[int]:
    """The mask read bit by bit: token t is allowed where bit t % 32 of word t // 32 is set."""
    words = row.tolist()
    return {token for token in range(min(vocab_size, 32 * len(words))) if words[token // 32] >> (token % 32) & 1}


def accepted_by_matcher(matcher, vocab_size: int) -> set[int]:
    return {token for token in range(vocab_size) if matcher.copy().accept_token(token)}


def mask_tokens(row: np.ndarray) -> np.ndarray:
    return np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))


def walk(backend, matcher, rng: random.Random, budget: int = 300) -> list[int] | None:
    """Random allowed tokens until the grammar is complete, EOS is drawn, or the output may end and a coin says so;
    the tokens (without EOS), or None if the budget ran out."""
    tokens: list[int] = []
    for _ in range(budget):
        if matcher.is_terminated() or (matcher.can_end() and rng.random() < 0.2):
            return tokens
        allowed = mask_tokens(mask_of(backend, matcher)).tolist()
        assert allowed, "a matcher that is not terminated must allow a token"
        token = rng.choice(allowed)
        if token in backend.end_tokens:
            assert matcher.can_end()
            return tokens
        assert matcher.accept_token(token)
        tokens.append(token)
    return None


@pytest.mark.parametrize("name", CONSTRAINTS)
def test_random_walks_end_in_text_that_satisfies_the_constraint(setup, name):
    backend, tokenizer, _ = setup
    params, satisfied = CONSTRAINTS[name]
    grammar = backend.compile(params)
    rng = random.Random(0)
    for _ in range(12):
        tokens = walk(backend, grammar.matcher(), rng)
        assert tokens is not None, "the walk did not end within its token budget"
        text = tokenizer.decode(tokens)
        assert satisfied(text), text


@pytest.mark.parametrize("name", [*CONSTRAINTS, "json_object"])
def test_the_mask_is_exactly_what_the_matcher_accepts(setup, name):
    backend, _, vocab_size = setup
    params = StructuredOutputsParams(json_object=True) if name == "json_object" else CONSTRAINTS[name][0]
    matcher = backend.compile(params).matcher()
    rng = random.Random(1)
    for _ in range(3):
        allowed = allowed_by_mask(backend, matcher, vocab_size)
        assert allowed == allowed_by_bits(mask_of(backend, matcher), vocab_size)
        # llguidance's mask may leave out a non-canonical tokenization of forced text that it would still accept
        assert allowed <= accepted_by_matcher(matcher, vocab_size)
        if matcher.is_terminated():
            assert allowed == backend.end_tokens
            break
        assert allowed and max(allowed) < len(setup[1])  # never a token past the tokenizer
        ordinary = sorted(allowed - backend.end_tokens)
        assert matcher.accept_token(rng.choice(ordinary))


def test_end_token_only_where_the_grammar_may_end(default_backend):
    (eos,) = default_backend.end_tokens
    matcher = default_backend.compile(StructuredOutputsParams(choice=["ab", "abc"])).matcher()
    assert not matcher.can_end() and eos not in mask_tokens(mask_of(default_backend, matcher))
    assert not matcher.copy().accept_token(eos)
    for token in default_backend.ll_tokenizer.tokenize_str("ab"):
        assert matcher.accept_token(token)
    assert matcher.can_end() and not matcher.is_terminated()
    assert eos in mask_tokens(mask_of(default_backend, matcher)) and matcher.copy().accept_token(eos)
    for token in default_backend.ll_tokenizer.tokenize_str("c"):
        assert matcher.accept_token(token)
    assert matcher.is_terminated() and matcher.can_end()
    assert mask_tokens(mask_of(default_backend, matcher)).tolist() == [eos]
    assert matcher.accept_token(eos)  # after the end, EOS changes nothing
    assert not matcher.accept_token(100)
    assert mask_tokens(mask_of(default_backend, matcher)).tolist() == [eos]
    matcher.rollback(1)  # undoes "c", not the EOS
    assert not matcher.is_terminated() and matcher.can_end()


def test_without_eos_a_terminated_matcher_allows_nothing(tiny_backend, tiny_tokenizer):
    stand_in = tiny_backend.hidden_end_token
    assert tiny_backend.end_tokens == frozenset() and stand_in in tiny_tokenizer.all_special_ids
    matcher = tiny_backend.compile(StructuredOutputsParams(regex="a+")).matcher()
    assert matcher.accept_token(tiny_tokenizer.convert_tokens_to_ids("a"))
    assert matcher.can_end() and stand_in not in mask_tokens(mask_of(tiny_backend, matcher))
    assert not matcher.accept_token(stand_in)
    matcher = tiny_backend.compile(StructuredOutputsParams(choice=["a"])).matcher()
    assert matcher.accept_token(tiny_tokenizer.convert_tokens_to_ids("a"))
    assert matcher.is_terminated()
    assert not mask_of(tiny_backend, matcher).any()  # the engine ends such a sequence before it samples again


def test_refused_token_changes_nothing(setup):
    backend, tokenizer, _ = setup
    matcher = backend.compile(StructuredOutputsParams(regex=PET_REGEX)).matcher()
    before = mask_of(backend, matcher)
    refused = next(token for token in range(len(tokenizer)) if token not in set(mask_tokens(before)))
    assert not matcher.accept_token(refused)
    np.testing.assert_array_equal(mask_of(backend, matcher), before)
    for token in backend.ll_tokenizer.tokenize_str("dog-7"):
        assert matcher.accept_token(token)
    assert matcher.can_end()


def test_rollback_reset_and_copy_return_the_same_masks(setup):
    backend, _, _ = setup
    matcher = backend.compile(StructuredOutputsParams(json=PERSON, whitespace_pattern="[ ]?")).matcher()
    rng = random.Random(2)
    masks, tokens = [mask_of(backend, matcher)], []
    for _ in range(8):
        ordinary = [token for token in mask_tokens(masks[-1]).tolist() if token not in backend.end_tokens]
        tokens.append(rng.choice(ordinary))
        assert matcher.accept_token(tokens[-1])
        masks.append(mask_of(backend, matcher))
    fork = matcher.copy()
    matcher.rollback(3)
    np.testing.assert_array_equal(mask_of(backend, matcher), masks[-4])
    np.testing.assert_array_equal(mask_of(backend, fork), masks[-1])  # a copy does not move with its original
    for token in tokens[-3:]:
        assert matcher.accept_token(token)
    np.testing.assert_array_equal(mask_of(backend, matcher), masks[-1])
    matcher.rollback(0)
    np.testing.assert_array_equal(mask_of(backend, matcher), masks[-1])
    matcher.reset()
    np.testing.assert_array_equal(mask_of(backend, matcher), masks[0])
    with pytest.raises(ValueError, match="cannot roll back 1 tokens"):
        matcher.rollback(1)


def test_two_matchers_of_one_grammar_are_independent(tiny_backend, tiny_tokenizer):
    grammar = tiny_backend.compile(StructuredOutputsParams(choice=["yes", "no"]))
    first, second = grammar.matcher(), grammar.matcher()
    start = mask_of(tiny_backend, second)
    for token in tiny_tokenizer.encode("yes"):
        assert first.accept_token(token)
    assert first.is_terminated() and not second.is_terminated()
    np.testing.assert_array_equal(mask_of(tiny_backend, second), start)
    np.testing.assert_array_equal(mask_of(tiny_backend, grammar.matcher()), start)


@pytest.mark.parametrize(
    ("params", "words"),
    [
        (dict(json={"type": "strin"}), ["structured_outputs.json", "Invalid type: strin"]),
        (dict(json={"type": "object", "dependentSchemas": {}}), ["structured_outputs.json", "dependentSchemas"]),
        (dict(json={"type": "string", "format": "no-such-format"}), ["structured_outputs.json", "no-such-format"]),
        (dict(regex="(ab"), ["structured_outputs.regex", "unclosed group"]),
        (dict(regex="a{2,1}"), ["structured_outputs.regex", "cannot be compiled"]),
        (dict(grammar="start: undefined_rule"), ["structured_outputs.grammar", "undefined_rule"]),
        (dict(grammar='root ::= "a'), ["structured_outputs.grammar", "GBNF"]),
        (dict(json_object=True, whitespace_pattern="(["), ["structured_outputs.whitespace_pattern", "character class"]),
    ],
)
def test_bad_constraints_are_value_errors_naming_the_problem(tiny_backend, params, words):
    with pytest.raises(ValueError) as raised:
        tiny_backend.compile(StructuredOutputsParams(**params))
    for word in words:
        assert word in str(raised.value)


def test_the_tokenizer_must_be_a_fast_one(tiny_tokenizer):
    with pytest.raises(ValueError, match="need the model's tokenizer"):
        load_backend(None, VOCAB_SIZE, [])
    with pytest.raises(ValueError, match="fast .Rust-backed. Hugging Face tokenizer, got dict"):
        load_backend({"a": 1}, VOCAB_SIZE, [])


def test_a_vocabulary_smaller_than_the_tokenizer_is_covered(tiny_tokenizer):
    backend = load_backend(tiny_tokenizer, VOCAB_SIZE - 100, [1])
    assert backend.vocab_size == len(tiny_tokenizer) and backend.end_tokens == {1}
    matcher = backend.compile(StructuredOutputsParams(regex="[a-z]+")).matcher()
    full = allowed_by_bits(mask_of(backend, matcher), len(tiny_tokenizer))
    assert allowed_by_mask(backend, matcher, VOCAB_SIZE - 100) == {token for token in full if token < VOCAB_SIZE - 100}
