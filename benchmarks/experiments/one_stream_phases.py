"""Is one sequence's decode bound by the device or by the host, and what do the one-row products cost in it? One
512-token prompt decoding N tokens on a `pagedllm bench` checkpoint: per decode step, the period (between two steps'
tokens reaching the scheduler), the device's own time (CUDA events around the forward and the sampling) and the
host's phases, medians over the steady steps. With --variants, in one process (processes differ by up to 0.1 ms a
step here), the one-row products go in turn to the GEMV, the skinny GEMM (tensor cores) and cuBLAS (or the GEMV
taking the LM head's row too: gemv_and_head), the batch-1 decode graph captured again for each, interleaved over
--rounds.

Run on a GPU after `pagedllm bench --shape S` wrote the checkpoint:
    python benchmarks/experiments/one_stream_phases.py --checkpoint /tmp/pagedllm-bench/qwen3-0.6b \
        [--variants gemv skinny cublas --rounds 3]
"""

from __future__ import annotations

import argparse
import random
import statistics

import torch
import torch.nn.functional as F

from pagedllm import LLM, SamplingParams

ONE_ROW = {  # what kernels/skinny_gemm.linear runs for one row, per variant
    "gemv": lambda skinny_gemm: skinny_gemm.gemv,
    "skinny": lambda skinny_gemm: skinny_gemm.skinny_linear,
    "cublas": lambda skinny_gemm: F.linear,
    "gemv_and_head": lambda skinny_gemm: skinny_gemm.gemv,  # the LM head's one row by the GEMV too
}


def decode_phases(llm: LLM, tokens: int, seed: int) -> dict:
    rng = random.Random(seed)
    records = []
    llm.llm_engine.add_step_listener(records.append, device_timings=True)
    prompt = {"prompt_token_ids": [rng.randrange(10, 10_000) for _ in range(512)]}
    llm.generate(prompt, SamplingParams(temperature=0.6, max_tokens=tokens, ignore_eos=True), use_tqdm=False)
    llm.llm_engine.remove_step_listener(records.append)
    decode = [record for record in records if record.num_decode_tokens][8:]  # steady steps
    ms = lambda values: 1e3 * statistics.median(values)  # noqa: E731
    return {
        "period": ms([b.resolved_at - a.resolved_at for a, b in zip(decode, decode[1:])]),
        "forward": statistics.median(record.events.forward_ms() for record in decode),
        "sampling": statistics.median(record.events.sampling_ms() for record in decode),
        "schedule": ms([r.batched_at - r.scheduled_at for r in decode]),
        "plan": ms([r.planned_at - r.batched_at for r in decode]),
        "launch": ms([r.launched_at - r.planned_at for r in decode]),
        "wait + read back": ms([r.resolved_at - r.resolve_started_at for r in decode]),
    }


@torch.inference_mode()
def recapture_one_sequence_graph(llm: LLM) -> None:
    graphs = llm.llm_engine.worker.graphs
    graphs.empty_inputs()
    graphs.forward(1)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graphs.hidden[:1] = graphs.forward(1)
    graph.replay()
    torch.cuda.synchronize()
    graphs.graphs[1] = graph


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--variants", nargs="*", choices=list(ONE_ROW), default=[])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--as-built-first", action="store_true", help="first a round on the graphs of start-up")
    args = parser.parse_args()
    llm = LLM(args.checkpoint, max_model_len=4096, skip_tokenizer_init=True)
    from pagedllm.kernels import skinny_gemm

    two_or_more = skinny_gemm.skinny_linear
    lm_head = llm.llm_engine.worker.model.lm_head
    head_product = lm_head.product
    plan = [(-1, "as built")] if args.as_built_first or not args.variants else []
    plan += [(round_index, variant) for round_index in range(args.rounds) for variant in args.variants]
    for round_index, variant in plan:
        if variant != "as built":
            one_row = ONE_ROW[variant](skinny_gemm)
            skinny_gemm.linear = lambda x, w, b=None, one_row=one_row: (
                one_row(x, w, b) if x.shape[0] == 1 else two_or_more(x, w, b)
            )
            lm_head.product = head_product
            if variant == "gemv_and_head":
                lm_head.product = lambda x, w, b=None: (
                    skinny_gemm.gemv(x, w, b) if x.shape[0] == 1 else F.linear(x, w, b)
                )
            recapture_one_sequence_graph(llm)
        result = decode_phases(llm, args.tokens, seed=max(round_index, 0))
        print(f"round {round_index} {variant}: period {result.pop('period'):.3f} ms; device forward "
              f"{result.pop('forward'):.3f} + sampling {result.pop('sampling'):.3f} ms; host "
              + ", ".join(f"{name} {value:.3f}" for name, value in result.items()), flush=True)  # fmt: skip
    llm.shutdown()


if __name__ == "__main__":
    main()
