"""Frontend Python cost per streamed token: building + JSON-encoding one SSE completion chunk, and msgspec encoding /
decoding of one engine step's output message (64 deltas). Prints microseconds; no model, no server.

    python benchmarks/frontend_cost.py
"""

from __future__ import annotations

import timeit

import msgspec

from pagedllm.entrypoints.openai.core_loop import CompletionDelta, EngineStats, RequestDelta, StepOutputs
from pagedllm.entrypoints.openai.protocol import CompletionRequest, CompletionResponse
from pagedllm.entrypoints.openai.serving import ChoiceProgress, OpenAIServing, PromptInput, sse
from pagedllm.outputs import CompletionOutput, RequestOutput


class NoEngine:
    tokenizer = None
    max_model_len = 4096


def main(repeats: int = 20000, batch: int = 64) -> None:
    serving = OpenAIServing(NoEngine(), "model", "model")
    request = CompletionRequest(prompt=[1, 2, 3], max_tokens=1000, stream=True)
    prompt = PromptInput(None, [1, 2, 3])
    previous_text, previous_ids = "x" * 400, list(range(100))

    def one_chunk() -> str:
        completion = CompletionOutput(0, previous_text + " token", previous_ids + [5])
        output = RequestOutput("request", None, prompt.token_ids, [completion])
        progress = ChoiceProgress(len(previous_text), len(previous_ids), started=True)
        choice = serving.completion_chunk_choice(request, prompt, output, completion, 0, progress)
        return sse(CompletionResponse(id="cmpl-x", created=1, model="model", choices=[choice]))

    chunk_us = 1e6 * timeit.timeit(one_chunk, number=repeats) / repeats
    deltas = [RequestDelta(f"request-{i}", [CompletionDelta(0, " token", [5])]) for i in range(batch)]
    message = StepOutputs(EngineStats(batch, 0, 0.5, 0, 0, 0), deltas=deltas)
    encoder, decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(StepOutputs)
    encoded = encoder.encode(message)
    encode_us = 1e6 * timeit.timeit(lambda: encoder.encode(message), number=2000) / 2000
    decode_us = 1e6 * timeit.timeit(lambda: decoder.decode(encoded), number=2000) / 2000
    print(f"one streamed completion chunk (build + JSON): {chunk_us:.1f} us")
    size = f"{batch} deltas, {len(encoded)} bytes"
    print(f"one step's message ({size}): encode {encode_us:.1f} us, decode {decode_us:.1f} us")


if __name__ == "__main__":
    main()
