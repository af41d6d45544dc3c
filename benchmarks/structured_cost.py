"""What structured outputs cost: decode step time at batch 1 and 32 with 0%, 50% and 100% of the rows constrained by a
JSON schema (the masks filled on the host, carried in the plan, applied in the sampler), and the first-token delay a
request's grammar compilation adds, on a compiler-cache miss and on a hit (and the compile alone). The embedded
default model (SmolLM2, a 49,152-token vocabulary: 1,536 mask words a row).

    python benchmarks/structured_cost.py [--device cpu|cuda] [--batch-sizes 1 32] [--output-len 48]
        [--model PATH | --shape NAME --tokenizer DIR]

--shape writes random bf16 weights of one of `pagedllm bench`'s shapes with the vocabulary of the tokenizer in DIR
(for a GPU machine where the default model is not at hand: save its tokenizer with save_pretrained and carry it).

The constrained rows follow SCHEMA, whose summary string is long enough that every row decodes all --output-len
tokens, so each step has all its rows. Each configuration runs once a round, interleaved; it prints the fastest
round's median decode step per configuration, its ratio to the unconstrained step, and the compile delays, with the
machine's load average (`os.getloadavg`) before and after.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from pagedllm import LLM, SamplingParams, StructuredOutputsParams
from pagedllm.entrypoints.bench_common import SHAPES, write_random_checkpoint

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["friend", "colleague", "family"]}, "maxItems": 3},
        "summary": {"type": "string", "minLength": 600, "maxLength": 2000},
    },
    "required": ["name", "age", "summary"],
}
# Free text without a length bound: every row's lexer sits in the same few states (inside a string, between items),
# the case a typical schema's long fields give; minItems keeps every row going for --output-len tokens.
NOTES_SCHEMA = {
    "type": "object",
    "properties": {"notes": {"type": "array", "items": {"type": "string"}, "minItems": 200}},
    "required": ["notes"],
}
SCHEMAS = {"long-summary": SCHEMA, "free-notes": NOTES_SCHEMA}
PROMPT = "Describe a person you know, as JSON with their name, age, tags and a long summary."


def row_params(batch_size: int, num_constrained: int, output_len: int, schema: dict) -> list[SamplingParams]:
    """Each row seeded, exactly output_len tokens; the first num_constrained rows follow schema."""
    constraint = StructuredOutputsParams(json=schema)
    return [
        SamplingParams(
            temperature=0.8,
            seed=row,
            max_tokens=output_len,
            ignore_eos=True,
            structured_outputs=constraint if row < num_constrained else None,
        )
        for row in range(batch_size)
    ]


def recorded_generate(llm: LLM, params: list[SamplingParams], device_timings: bool = False) -> tuple[list, list]:
    """PROMPT once per row: the outputs, and the record of every step (with device timings if asked)."""
    records = []
    engine = llm.llm_engine
    engine.add_step_listener(records.append, device_timings=device_timings)
    try:
        outputs = llm.generate([PROMPT] * len(params), params, use_tqdm=False)
    finally:
        engine.remove_step_listener(records.append)
    return outputs, records


def decode_step_ms(llm: LLM, batch_size: int, num_constrained: int, output_len: int, schema: dict = SCHEMA) -> float:
    """The median time of the decode steps in which every row samples; the first num_constrained rows follow
    schema."""
    outputs, records = recorded_generate(llm, row_params(batch_size, num_constrained, output_len, schema))
    assert all(len(output.outputs[0].token_ids) == output_len for output in outputs), "a row ended early"
    steps = [
        later.resolved_at - earlier.resolved_at
        for earlier, later in zip(records, records[1:])
        if later.num_decode_tokens == batch_size and later.num_prefill_tokens == 0
    ]
    return 1000 * statistics.median(steps)


def first_token_ms(llm: LLM, constraint: StructuredOutputsParams | None) -> float:
    """From add_request to the request's first token (a prompt step alone, then that token)."""
    engine = llm.llm_engine
    request_id = engine.next_request_id()
    started = time.perf_counter()
    engine.add_request(request_id, PROMPT, SamplingParams(max_tokens=1, structured_outputs=constraint))
    while engine.has_unfinished_requests():
        engine.step()
    return 1000 * (time.perf_counter() - started)


def compile_delays(llm: LLM, repeats: int = 5) -> tuple[float, float, float]:
    """Median first-token time without a constraint, and the extra with a schema compiled anew (each run changes
    its title, so the compiler's cache misses) and with the same schema again (a hit)."""
    first_token_ms(llm, StructuredOutputsParams(json={"type": "object"}))  # loads the backend (once per engine)
    free, miss, hit = [], [], []
    for run in range(repeats):
        free.append(first_token_ms(llm, None))
        schema = {**SCHEMA, "title": f"person {run}"}
        miss.append(first_token_ms(llm, StructuredOutputsParams(json=schema)))
        hit.append(first_token_ms(llm, StructuredOutputsParams(json=schema)))
    base = statistics.median(free)
    return base, statistics.median(miss) - base, statistics.median(hit) - base


def compile_ms(llm: LLM, repeats: int = 5) -> tuple[float, float]:
    """Median time from submitting a typical schema to the compiler to its grammar being ready: a new schema (a
    cache miss), and the same one again (a hit)."""
    compiler = llm.llm_engine.grammars.compiler
    miss, hit = [], []
    for run in range(repeats):
        constraint = StructuredOutputsParams(json={**SCHEMA, "title": f"compiled {run}"})
        for times in (miss, hit):
            started = time.perf_counter()
            compiler.submit(constraint).result()
            times.append(1000 * (time.perf_counter() - started))
    return statistics.median(miss), statistics.median(hit)


def random_checkpoint_with_tokenizer(shape: str, tokenizer_dir: str, device: torch.device) -> Path:
    """Random weights of a bench shape whose vocabulary is the tokenizer's, and the tokenizer beside them."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    directory = Path(tempfile.mkdtemp(prefix=f"pagedllm-structured-{shape}-"))
    write_random_checkpoint(shape, directory, device, vocab_size=len(tokenizer))
    tokenizer.save_pretrained(directory)
    return directory


def print_step_table(llm: LLM, args: argparse.Namespace, schema: dict) -> None:
    """Each (batch size, constrained share) once a round, interleaved; print the fastest round's median step."""
    decode_step_ms(llm, 2, 1, 8, schema)  # warm: the backend, the compiled schema, every path of a step
    print(f"load average at start: {os.getloadavg()[0]:.2f}")
    configs = list(  # (batch size, constrained rows), each once
        dict.fromkeys((size, round(size * fraction)) for size in args.batch_sizes for fraction in args.fractions)
    )
    best = dict.fromkeys(configs, float("inf"))  # the fastest round's median: the least disturbed by other work
    for _ in range(args.rounds):
        for batch_size, num_constrained in configs:
            step = decode_step_ms(llm, batch_size, num_constrained, args.output_len, schema)
            best[batch_size, num_constrained] = min(best[batch_size, num_constrained], step)
    print(f"{'batch':>5} {'constrained':>11} {'step ms':>8} {'vs none':>8}")
    for batch_size, num_constrained in configs:
        ratio = best[batch_size, num_constrained] / best[batch_size, 0]
        share = f"{num_constrained} ({num_constrained / batch_size:.0%})"
        print(f"{batch_size:>5} {share:>11} {best[batch_size, num_constrained]:>8.2f} {ratio:>8.3f}")
    print(f"load average at the end: {os.getloadavg()[0]:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.0, 0.5, 1.0])
    parser.add_argument("--output-len", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3, help="each configuration once a round, interleaved")
    parser.add_argument("--threads", type=int, default=1, help="torch's CPU threads (shared cores: 1 is steadier)")
    parser.add_argument("--model", default=None, help="a checkpoint (default: the embedded default model)")
    parser.add_argument("--shape", choices=SHAPES, help="random weights of this shape instead, with --tokenizer")
    parser.add_argument("--tokenizer", help="a saved Hugging Face tokenizer directory, for --shape")
    parser.add_argument(
        "--schema", choices=SCHEMAS, nargs="+", default=["long-summary"],
        help="long-summary: a 600-2000 character string (each row in its own lexer state); free-notes: strings "
        "without a length bound; several run one after another on one engine",
    )  # fmt: skip
    args = parser.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    model = args.model
    if args.shape is not None:
        if args.tokenizer is None:
            parser.error("--shape needs --tokenizer")
        model = str(random_checkpoint_with_tokenizer(args.shape, args.tokenizer, torch.device(args.device)))
    max_num_seqs = max(256, *args.batch_sizes)
    llm = LLM(model, device=args.device, max_model_len=1024, max_num_seqs=max_num_seqs)
    for schema in args.schema:
        print(f"model: {args.shape or model or 'the default model'}, device {args.device}, schema {schema}")
        print_step_table(llm, args, SCHEMAS[schema])
    base, miss, hit = compile_delays(llm)
    print(f"first token without a constraint: {base:.1f} ms; compile delay on a cache miss: {miss:+.1f} ms, on a hit: "
          f"{hit:+.1f} ms (load {os.getloadavg()[0]:.2f})")  # fmt: skip
    miss, hit = compile_ms(llm)
    print(f"the schema's compile alone: {miss:.2f} ms on a cache miss, {hit:.3f} ms on a hit")


if __name__ == "__main__":
    main()
