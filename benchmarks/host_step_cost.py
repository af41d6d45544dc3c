"""The engine's own host work per step (scheduler, block manager, plan building, output handling), with the device
taken out: the engine is built with an executor that answers every plan at once with random tokens. On a GPU this host
work overlaps the device's step (async scheduling); where the device step is shorter, the host sets the pace.

    python benchmarks/host_step_cost.py [--num-seqs 256] [--output-len 256] [--profile]

Plans are built as on CUDA (block tables as wide as max_model_len needs). Prints ms per decode step, and with
--profile the functions that take the most time. By default there is no tokenizer, as in `pagedllm bench`;
--with-tokenizer runs the embedded default model's engine instead (its tokenizer, requests as LLM.generate adds
them), so the output text is made as a user's generate() makes it.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import tempfile
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from pagedllm import SamplingParams
from pagedllm.config import EngineConfig
from pagedllm.engine.engine import LLMEngine
from pagedllm.executor.step_output import StepOutput
from pagedllm.loader.checkpoint import open_checkpoint
from pagedllm.sampling.sampler import SamplerOutput


class InstantExecutor:
    """An Executor (pagedllm/executor/executor.py) with no model: answers each plan with random token ids, on the
    host, at once."""

    def __init__(self, num_kv_blocks: int, vocab_size: int):
        self.device, self.num_kv_blocks = torch.device("cpu"), num_kv_blocks
        self.vocab_size = vocab_size
        self.generator = torch.Generator().manual_seed(0)

    def execute(self, plan, previous=None, masks=None) -> StepOutput:
        if masks is not None:
            masks()  # the protocol: asked for once per constrained plan
        tokens = torch.randint(1, self.vocab_size, (plan.num_sampled,), generator=self.generator)
        return StepOutput(plan.step_id, SamplerOutput(tokens) if plan.num_sampled else None)

    def set_device_timings(self, on: bool) -> None:
        """No device: nothing to time."""

    def shutdown(self) -> None:
        """Holds nothing."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--sort", default="tottime", help="profile order: tottime or cumulative")
    parser.add_argument("--with-tokenizer", action="store_true", help="the default model's engine and tokenizer")
    args = parser.parse_args()
    torch.set_num_threads(1)
    num_kv_blocks = args.num_seqs * (args.prompt_len + args.output_len) // 16 + args.num_seqs
    settings = dict(max_model_len=args.max_model_len, num_kv_blocks=num_kv_blocks, async_scheduling=True)
    if args.with_tokenizer:
        vocab_size = open_checkpoint(None, load_tokenizer=False, write_cache=False).hf_config.vocab_size
        engine = LLMEngine(EngineConfig(**settings), InstantExecutor(num_kv_blocks, vocab_size))
    else:
        with tempfile.TemporaryDirectory() as directory:
            shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4)
            config = LlamaConfig(
                vocab_size=32000, num_key_value_heads=2, max_position_embeddings=args.max_model_len, **shape
            )
            LlamaForCausalLM(config).save_pretrained(directory)
            engine_config = EngineConfig(directory, skip_tokenizer_init=True, **settings)
            engine = LLMEngine(engine_config, InstantExecutor(num_kv_blocks, config.vocab_size))
    params = SamplingParams(temperature=0.6, max_tokens=args.output_len, ignore_eos=True)
    for index in range(args.num_seqs):
        prompt = [(7 * index + position) % 30000 + 1 for position in range(args.prompt_len)]
        engine.add_request(f"r{index}", {"prompt_token_ids": prompt}, params, stream=False)
    while any(seq.num_output_tokens == 0 for seq in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()  # the prefill steps
    records = []
    engine.add_step_listener(records.append)
    profiler = cProfile.Profile() if args.profile else None
    steps, start = 0, time.perf_counter()
    if profiler is not None:
        profiler.enable()
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    if profiler is not None:
        profiler.disable()
    elapsed = time.perf_counter() - start
    print(
        f"{steps} decode steps of up to {args.num_seqs} sequences: {1e3 * elapsed / steps:.3f} ms of host work per step"
    )
    phases = {
        "schedule": lambda record: record.batched_at - record.scheduled_at,
        "build the plan": lambda record: record.planned_at - record.batched_at,
        "execute (instant executor) and record": lambda record: record.launched_at - record.planned_at,
        "resolve: hand tokens to sequences, stop checks": lambda record: record.resolved_at - record.resolve_started_at,
    }
    for name, phase in phases.items():
        print(f"    {name}: {1e3 * sum(map(phase, records)) / len(records):.3f} ms per step")
    if profiler is not None:
        pstats.Stats(profiler).sort_stats(args.sort).print_stats(30)


if __name__ == "__main__":
    main()
