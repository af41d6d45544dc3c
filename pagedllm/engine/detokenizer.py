"""Incremental detokenization of one request's output: new text as whole UTF-8 characters, stop strings, and the
text a stream may show (never what a stop string could still remove)."""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

from pagedllm.engine.stop_checker import StopChecker
from pagedllm.sampling.params import SamplingParams

# Tokens decoded before the undecoded tail when it is flushed: enough context for a leading space or a merge.
FLUSH_CONTEXT = 4
# A UTF-8 character spans at most 4 bytes, so at most 3 trailing tokens of a prompt can sit inside one.
MAX_TOKENS_INSIDE_A_CHARACTER = 3


def primed_stream(backend, prompt_token_ids: list[int], skip_special_tokens: bool) -> DecodeStream:
    """A DecodeStream that has seen the prompt, so the first output token decodes in context (its leading space).

    DecodeStream(ids=prompt) returns the whole prompt's text with the first output piece when that text ends inside
    a character (tokenizers 0.23 keeps no prefix then). So it is seeded with the prompt up to its last whole
    character, and the tokens after it are stepped through: their bytes wait in the stream, and show with the output's
    first piece (as U+FFFD if the output does not complete them), as vLLM's primed stream shows them. A prompt whose
    last tokens form no character at all (bytes no later byte completes) primes an empty stream with its last
    FLUSH_CONTEXT tokens: the output's first piece may then show those few tokens' text, never the whole prompt's."""
    ends_inside = lambda end: backend.decode(
        prompt_token_ids[max(0, end - FLUSH_CONTEXT) : end], skip_special_tokens=skip_special_tokens
    ).endswith("\ufffd")
    cut = len(prompt_token_ids)
    while cut > max(0, len(prompt_token_ids) - MAX_TOKENS_INSIDE_A_CHARACTER) and ends_inside(cut):
        cut -= 1
    if cut > 0 and ends_inside(cut):
        seed, rest = [], prompt_token_ids[-FLUSH_CONTEXT:]
    else:
        seed, rest = prompt_token_ids[:cut], prompt_token_ids[cut:]
    stream = DecodeStream(ids=list(seed), skip_special_tokens=skip_special_tokens)
    for token_id in rest:
        stream.step(backend, token_id)  # their text, if any, is the prompt's
    return stream


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams | None = None):
        params = params or SamplingParams()
        self.backend = tokenizer.backend_tokenizer  # the Rust tokenizer under a transformers fast tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        self.stop_checker = StopChecker(params.stop, params.include_stop_str_in_output) if params.stop else None
        self.stream = primed_stream(self.backend, list(prompt_token_ids), params.skip_special_tokens)
        self.decoded_ids = list(prompt_token_ids[-FLUSH_CONTEXT:])  # the last ids whose text is in self.text
        self.undecoded_ids: list[int] = []  # ids after them that do not yet end on a whole character
        self.num_output_tokens = 0
        self.text = ""  # the output text so far; ends before a matched stop string (unless it is included)
        self.stop_reason: str | None = None  # the stop string that ended the text

    def update(self, token_ids: list[int], stop_terminated: bool = False) -> str | None:
        """Feed new output tokens. stop_terminated: the last one is the EOS or stop token that ends the request; its
        text is left out unless include_stop_str_in_output. Returns the stop string that ended the text, if any:
        the request is then finished (finish_reason "stop", stop_reason that string) and takes no more tokens."""
        assert self.stop_reason is None, "tokens after a stop string"
        if stop_terminated and not self.include_stop_str_in_output:
            self.num_output_tokens += 1
            token_ids = token_ids[:-1]
        for token_id in token_ids:
            self.num_output_tokens += 1
            new_text = self.stream.step(self.backend, token_id)
            self.undecoded_ids.append(token_id)
            if not new_text:
                continue
            self.decoded_ids = (self.decoded_ids + self.undecoded_ids)[-FLUSH_CONTEXT:]
            self.undecoded_ids = []
            num_chars = len(self.text)
            self.text += new_text
            if self.stop_checker is not None and self.num_output_tokens >= self.min_tokens:
                match = self.stop_checker.find(self.text, num_chars)
                if match is not None:
                    self.text = self.text[: match.end]
                    self.stop_reason = match.stop
                    return match.stop
        return None

    def can_decode_at_end(self) -> bool:
        """Whether decode_all() may make the text: not with stop strings (they are checked as the text grows), nor
        after a prompt that ends inside a character (its U+FFFD would then start the output token by token, but
        not at once)."""
        if self.stop_checker is not None:
            return False
        context_text = self.backend.decode(self.decoded_ids, skip_special_tokens=self.skip_special_tokens)
        return not context_text.endswith("\ufffd")

    def decode_all(self, token_ids: list[int], stop_terminated: bool = False) -> None:
        """The whole output in one decode, for a request that nobody reads while it runs and that has no stop
        strings: the same text as update() token by token and then finish(), at one tokenizer call per request
        instead of one per token."""
        # The caller asked can_decode_at_end() when the request came (a tokenizer call); only its cheap half here.
        assert self.num_output_tokens == 0 and self.stop_checker is None, "decode_all takes the whole output, once"
        self.num_output_tokens = len(token_ids)
        if stop_terminated and not self.include_stop_str_in_output:
            token_ids = token_ids[:-1]
        self.undecoded_ids = list(token_ids)
        self.finish()

    def finish(self) -> None:
        """The request ended: show a trailing incomplete character as U+FFFD, as tokenizer.decode does."""
        if not self.undecoded_ids or self.stop_reason is not None:
            return
        decode = lambda ids: self.backend.decode(ids, skip_special_tokens=self.skip_special_tokens)
        context_text = decode(self.decoded_ids)
        self.text += decode(self.decoded_ids + self.undecoded_ids)[len(context_text) :]
        self.undecoded_ids = []

    def output_text(self, finished: bool) -> str:
        """The text a request's output may show now: while running, not the last characters a stop string could
        still remove."""
        if finished or self.stop_checker is None:
            return self.text
        return self.text[: max(len(self.text) - self.stop_checker.holdback, 0)]
