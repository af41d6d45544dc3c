"""The README's trace: the default model answers 12 chats that share a system prompt, on a KV cache of 48 blocks and
with 128 tokens per step, so prefix sharing, paging and preemption all show. Writes the trace to the given file
(default trace.json).

Run: python scripts/trace_demo.py /tmp/demo.json
     pagedllm trace-summary /tmp/demo.json --plot docs/images/trace_plot.png --kv-picture docs/images/kv_cache.png \
         --step 50
"""

from __future__ import annotations

import sys

from pagedllm import LLM, SamplingParams

SYSTEM = (
    "You are a patient teacher for curious children and their parents. Answer in two or three plain sentences, "
    "give one concrete example from everyday life, and avoid jargon unless the student asks for it. If a question "
    "is unclear, say what you assume before you answer. Never invent facts; when you are not sure, say so."
)
QUESTIONS = [
    "Why is the sky blue?", "What is a prime number?", "How do plants make food?", "What is gravity?",
    "Why do we have seasons?", "What is a computer program?", "How does a rainbow form?", "What is an atom?",
    "Why does ice float?", "What is electricity?", "How do bees make honey?", "What causes the tides?",
]  # fmt: skip


def main() -> None:
    path = sys.argv[1] if len(sys.argv) > 1 else "trace.json"
    llm = LLM(num_kv_blocks=48, max_num_batched_tokens=128, trace_file=path, trace_kv_every=2)
    chats = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}] for q in QUESTIONS]
    outputs = llm.chat(chats, SamplingParams(temperature=0, max_tokens=48))
    for question, output in zip(QUESTIONS, outputs):
        print(f"{question} -> {output.outputs[0].text[:70]!r}")


if __name__ == "__main__":
    main()
