"""Turn what a user passes as a prompt or a chat into checked (text, token ids), with errors that say what to change.

A prompt is a str, {"prompt": str} (vLLM's TextPrompt) or {"prompt_token_ids": ids} (vLLM's TokensPrompt, which may
also carry the text as "prompt"); ids are a list/tuple of ints (numpy integers too) or a 1-D integer numpy array.
"""

from __future__ import annotations

import reprlib

import numpy as np

PROMPT_FORMS = "a str, a {'prompt': str} dict or a {'prompt_token_ids': [int, ...]} dict"
PROMPT_KEYS = ("prompt", "prompt_token_ids")
MESSAGE_FORM = "a dict {'role': str, 'content': str}"


def process_prompt(prompt: object, tokenizer, vocab_size: int) -> tuple[str | None, list[int]]:
    """(text or None, token ids) of one prompt; ValueError/TypeError naming `prompt` or `prompt_token_ids`."""
    if isinstance(prompt, str):
        return prompt, encode_text(prompt, tokenizer)
    if not isinstance(prompt, dict):
        hint = " (decode bytes to str first)" if isinstance(prompt, bytes | bytearray) else ""
        raise TypeError(f"prompt must be {PROMPT_FORMS}, got {describe(prompt)}{hint}")
    unknown = sorted(str(key) for key in prompt if key not in PROMPT_KEYS)
    if unknown:
        raise ValueError(f"prompt dict has unsupported key(s) {unknown}; a prompt is {PROMPT_FORMS}")
    text = prompt.get("prompt")
    if text is not None and not isinstance(text, str):
        raise TypeError(f"prompt['prompt'] must be a str, got {describe(text)}")
    if "prompt_token_ids" in prompt:
        return text, check_token_ids(prompt["prompt_token_ids"], vocab_size)
    if text is None:
        raise ValueError(f"prompt dict has neither 'prompt' nor 'prompt_token_ids'; a prompt is {PROMPT_FORMS}")
    return text, encode_text(text, tokenizer)


def encode_text(text: str, tokenizer) -> list[int]:
    if not text:
        raise ValueError("the prompt is empty; give at least one character or token")
    if tokenizer is None:
        raise ValueError("skip_tokenizer_init=True: give prompts as {'prompt_token_ids': [...]}")
    check_text(text, "prompt")
    token_ids = tokenizer.encode(text)
    if not token_ids:
        raise ValueError(
            f"the prompt {reprlib.repr(text)} tokenizes to zero tokens (this tokenizer drops it, e.g. whitespace); "
            "give text that yields at least one token"
        )
    return list(token_ids)


def check_text(text: str, what: str) -> None:
    """Text must be encodable as UTF-8: a lone surrogate (e.g. '\\ud800' from a bad decode) is not."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        character = text[error.start]
        raise ValueError(
            f"{what} holds a lone surrogate U+{ord(character):04X} at index {error.start}, which is not valid "
            "Unicode text; decode its bytes with errors='replace' (or remove it) first"
        ) from None


def check_token_ids(token_ids: object, vocab_size: int) -> list[int]:
    """Token ids as plain Python ints, each in [0, vocab_size)."""
    if isinstance(token_ids, np.ndarray):
        if token_ids.ndim != 1 or not np.issubdtype(token_ids.dtype, np.integer):
            raise TypeError(
                f"prompt_token_ids as a numpy array must be 1-D of an integer dtype, got {token_ids.ndim}-D "
                f"{token_ids.dtype}"
            )
        token_ids = token_ids.tolist()
    if not isinstance(token_ids, list | tuple):
        raise TypeError(
            f"prompt_token_ids must be a list of ints (or a 1-D integer numpy array), got {describe(token_ids)}"
        )
    if not token_ids:
        raise ValueError("prompt_token_ids must be a non-empty list of token ids")
    if all(type(token_id) is int for token_id in token_ids) and min(token_ids) >= 0 and max(token_ids) < vocab_size:
        return list(token_ids)  # the common case in one pass (bool is not exactly int); otherwise say what is wrong
    for index, token_id in enumerate(token_ids):
        if isinstance(token_id, bool) or not isinstance(token_id, int | np.integer):
            hint = "; for several prompts pass a list of prompt dicts" if isinstance(token_id, list | tuple) else ""
            raise TypeError(
                f"prompt_token_ids must be a flat list of ints, but item {index} is {describe(token_id)}{hint}"
            )
    bad = [int(t) for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(
            f"prompt_token_ids holds {len(bad)} id(s) outside the vocabulary [0, {vocab_size}), e.g. {bad[0]}"
        )
    return [int(t) for t in token_ids]


def check_conversation(conversation: object, where: str) -> None:
    """A conversation is a non-empty list of {'role': str, 'content': str} dicts; errors name `where`[index]."""
    if not isinstance(conversation, list | tuple):
        raise TypeError(f"{where} must be a list of messages, each {MESSAGE_FORM}; got {describe(conversation)}")
    if not conversation:
        raise ValueError(f"{where} is an empty conversation; give at least one message, each {MESSAGE_FORM}")
    for index, message in enumerate(conversation):
        if not isinstance(message, dict):
            raise TypeError(f"{where}[{index}] must be {MESSAGE_FORM}, got {describe(message)}")
        for key in ("role", "content"):
            if key not in message:
                raise ValueError(f"{where}[{index}] has no {key!r} key; each message is {MESSAGE_FORM}")
            if not isinstance(message[key], str):
                raise TypeError(f"{where}[{index}][{key!r}] must be a str, got {describe(message[key])}")
            check_text(message[key], f"{where}[{index}][{key!r}]")


def describe(value: object) -> str:
    """A short description of a bad value for an error message: its type and a truncated repr."""
    return f"{type(value).__name__} {reprlib.repr(value)}"
