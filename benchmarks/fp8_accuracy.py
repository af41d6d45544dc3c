"""Accuracy of the fp8 KV cache against a cache in the model's dtype, measured, not assumed.

CPU (default): the embedded SmolLM2-135M in float32, benchmarks/cpu_generate.py's 32 chat prompts, greedy, 64 new
tokens. Prints (1) the share of generated tokens equal to the float32-cache run before each prompt's first
divergence; (2) over the float32 run's outputs, teacher-forced (prompt + output in one forward through the
engine's model and cache), the mean absolute difference of the chosen tokens' logprobs between the two caches, and
for scale the same for the whole model in bfloat16 (the usual GPU precision) with a bf16 cache; (3) the error of
each scaling scheme on the model's real K/V rows, to justify per-(token, head) scales.
GPU (--gpu-default): the default model, the same chat prompts, bf16 against fp8 caches and fp8 weights quantized
at load, each generated token scored as below against transformers' float32 forward of the same GGUF.
GPU (--gpu-tiny): tiny checkpoints (tests/conftest.py's, a 128-wide one, and one whose layers take 128 x 128
blocks, in_features divisible by 512) in bf16 with bf16 and fp8 caches, and with fp8 weights (row and block
scaling): each generated token is scored by one float32 transformers forward over prompt + output (gap = best
logit - chosen logit).

Run: python benchmarks/fp8_accuracy.py [--threads N] [--num-prompts 32] [--new-tokens 64] [--gpu-tiny | --gpu-default]
Writes $OUT/fp8_accuracy.json when OUT is set.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
from cpu_generate import chat_prompts  # noqa: E402

from pagedllm import LLM, SamplingParams  # noqa: E402
from pagedllm.attention.fp8 import FP8_DTYPE, FP8_MAX, dequantize_fp8, quantize_fp8  # noqa: E402


def engine_model(llm: LLM) -> torch.nn.Module:
    engine = llm.llm_engine
    owner = getattr(engine, "runner", None) or getattr(engine, "worker", None)
    return owner.model


def generate(llm: LLM, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [output.outputs[0].token_ids for output in outputs]


def teacher_forced_logprobs(llm: LLM, prompt: list[int], output: list[int]) -> torch.Tensor:
    """[len(output), vocab] log-softmax at the positions that predict output, from one prefill of prompt + output
    (each position attends to the cache as stored, as in decoding). Needs prefix caching off."""
    model = engine_model(llm)
    hidden_states = []
    original = model.forward

    def recording(*args, **kwargs):
        hidden = original(*args, **kwargs)
        hidden_states.append(hidden)
        return hidden

    model.forward = recording
    try:
        generate(llm, [prompt + output], 1)
    finally:
        model.forward = original
    assert len(hidden_states) == 1, "the whole sequence must be one step: raise max_num_batched_tokens"
    rows = hidden_states[0][len(prompt) - 1 : len(prompt) + len(output) - 1]
    return torch.log_softmax(model.compute_logits(rows).float(), -1)


def agreement_before_divergence(reference: list[list[int]], other: list[list[int]]) -> float:
    """Tokens equal to the reference before each sequence's first divergence, over all generated tokens."""
    same = 0
    for a, b in zip(reference, other):
        same += next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
    return same / sum(map(len, reference))


def record_kv_rows(llm: LLM, prompts: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The K and V rows ([tokens, kv_heads, head_dim]) every layer stores while prefilling the prompts."""
    layers = [m for m in engine_model(llm).modules() if hasattr(m, "k_cache")]
    records: list[tuple[torch.Tensor, torch.Tensor]] = []
    backend = layers[0].backend
    original = backend.forward

    def recording(query, key, value, *args, **kwargs):
        records.append((key.detach().float().clone(), value.detach().float().clone()))
        return original(query, key, value, *args, **kwargs)

    backend.forward = recording
    try:
        generate(llm, prompts, 1)
    finally:
        backend.forward = original
    return records


def per_tensor_fp8(rows: torch.Tensor, scale: float) -> torch.Tensor:
    """Round trip through e4m3 with one scale for the whole tensor (values beyond 448 * scale clip)."""
    return (rows / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).float() * scale


def scaling_errors(records: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, dict[str, float]]:
    """Relative RMS error of K and V (over all layers) under each scaling scheme, the mean relative error of a
    (token, head) row, and the share of values that the scheme flushes to zero (nonzero values that come back 0)."""
    schemes = {
        "per (token, head), dynamic [ours]": lambda x: dequantize_fp8(*quantize_fp8(x), torch.float32),
        "per token, dynamic": lambda x: dequantize_fp8(*quantize_fp8(x.flatten(1)), torch.float32).view_as(x),
        "per tensor, max of these prompts (calibrated)": lambda x: per_tensor_fp8(x, x.abs().max().item() / FP8_MAX),
        "per tensor, scale 1 (no calibration)": lambda x: per_tensor_fp8(x, 1.0),
    }
    results = {}
    for name, round_trip in schemes.items():
        row = {}
        for which, index in (("K", 0), ("V", 1)):
            squared_error = squared_norm = flushed = nonzero = row_error = num_rows = 0.0
            for record in records:
                rows = record[index]
                restored = round_trip(rows)
                squared_error += (restored - rows).square().sum().item()
                squared_norm += rows.square().sum().item()
                flushed += ((restored == 0) & (rows != 0)).sum().item()
                nonzero += (rows != 0).sum().item()
                row_norms = rows.norm(dim=-1)  # each (token, head) row's own relative error: small rows count too
                row_error += ((restored - rows).norm(dim=-1) / row_norms.clamp_min(1e-30)).sum().item()
                num_rows += row_norms.numel()
            row[f"{which} rel rms error"] = (squared_error / squared_norm) ** 0.5
            row[f"{which} mean row error"] = row_error / num_rows
            row[f"{which} flushed to 0"] = flushed / nonzero
        results[name] = row
    return results


def cpu_accuracy(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    engines = {name: LLM(dtype="float32", device="cpu", kv_cache_dtype=name, enable_prefix_caching=False)
               for name in ("auto", "fp8")}  # fmt: skip
    prompts = chat_prompts(engines["auto"], args.num_prompts)
    start = time.perf_counter()
    outputs = {name: generate(llm, prompts, args.new_tokens) for name, llm in engines.items()}
    generate_s = time.perf_counter() - start
    engines["bf16 model"] = LLM(dtype="bfloat16", device="cpu", enable_prefix_caching=False)  # teacher-forced only
    differences = {"fp8": [], "bf16 model": []}
    flips = dict.fromkeys(("auto", "fp8", "bf16 model"), 0)  # "auto": 0 unless a float32 near-tie
    for prompt, output in zip(prompts, outputs["auto"]):
        chosen = torch.tensor(output)
        logprobs = {name: teacher_forced_logprobs(llm, prompt, output) for name, llm in engines.items()}
        picked = {name: lp[torch.arange(len(output)), chosen] for name, lp in logprobs.items()}
        for name in flips:
            flips[name] += int((logprobs[name].argmax(-1) != chosen).sum())
        for name in differences:
            differences[name].append((picked[name] - picked["auto"]).abs())
    differences = {name: torch.cat(values) for name, values in differences.items()}
    num_positions = len(differences["fp8"])
    sampled_prompts = prompts[:: max(1, len(prompts) // 8)]
    kv_rows = record_kv_rows(engines["auto"], sampled_prompts)
    result = {
        "model": "SmolLM2-135M-Instruct (Q4_1 GGUF, float32)",
        "num_prompts": len(prompts),
        "prompt_tokens": [min(map(len, prompts)), max(map(len, prompts))],
        "new_tokens": args.new_tokens,
        "tokens_equal_before_first_divergence": agreement_before_divergence(outputs["auto"], outputs["fp8"]),
        "sequences_identical": sum(a == b for a, b in zip(outputs["auto"], outputs["fp8"])),
        "teacher_forced_mean_abs_logprob_diff": differences["fp8"].mean().item(),
        "teacher_forced_max_abs_logprob_diff": differences["fp8"].max().item(),
        "teacher_forced_argmax_changes": flips["fp8"] / num_positions,
        "teacher_forced_float32_argmax_changes": flips["auto"] / num_positions,
        "bf16_model_mean_abs_logprob_diff": differences["bf16 model"].mean().item(),
        "bf16_model_max_abs_logprob_diff": differences["bf16 model"].max().item(),
        "bf16_model_argmax_changes": flips["bf16 model"] / num_positions,
        "scaling_schemes": scaling_errors(kv_rows),
        "scaling_schemes_prompts": len(sampled_prompts),
        "generate_s_both_runs": generate_s,
    }
    print_cpu(result)
    return result


def print_cpu(result: dict) -> None:
    low, high = result["prompt_tokens"]
    print(f"\n{result['model']}: {result['num_prompts']} chat prompts ({low}-{high} tokens), greedy, "
          f"{result['new_tokens']} new tokens; fp8 cache against the float32 cache")  # fmt: skip
    print("| measure | value |\n|---|---|")
    print(
        f"| generated tokens equal before the first divergence | {result['tokens_equal_before_first_divergence']:.1%} |"
    )
    print(f"| sequences identical | {result['sequences_identical']} of {result['num_prompts']} |")
    mean, worst = result["teacher_forced_mean_abs_logprob_diff"], result["teacher_forced_max_abs_logprob_diff"]
    print(f"| teacher-forced: mean abs difference of the chosen tokens' logprobs | {mean:.4f} (max {worst:.3f}) |")
    print(f"| teacher-forced: positions whose argmax changes | {result['teacher_forced_argmax_changes']:.2%} |")
    mean, worst = result["bf16_model_mean_abs_logprob_diff"], result["bf16_model_max_abs_logprob_diff"]
    print(f"| for scale, the model in bf16: mean abs logprob difference | {mean:.4f} (max {worst:.3f}) |")
    print(
        f"| for scale, the model in bf16: positions whose argmax changes | {result['bf16_model_argmax_changes']:.2%} |"
    )
    count = result["scaling_schemes_prompts"]
    print(f"\nScaling schemes on the model's K/V rows (prefill of {count} prompts, all layers):")
    print_schemes(result["scaling_schemes"])


def print_schemes(schemes: dict[str, dict[str, float]]) -> None:
    print("| scheme | K / V rel rms error | K / V mean row error | K / V flushed to 0 |\n|---|---|---|---|")
    for name, row in schemes.items():
        print(f"| {name} | {row['K rel rms error']:.4f} / {row['V rel rms error']:.4f} | "
              f"{row['K mean row error']:.4f} / {row['V mean row error']:.4f} | "
              f"{row['K flushed to 0']:.2%} / {row['V flushed to 0']:.2%} |")  # fmt: skip


# (label, LLM keywords, PAGEDLLM_FP8_SCALING) of each GPU run; the checkpoints' weights are float32 as written
GPU_RUNS = [
    ("bf16 model, bf16 cache", {}, None),
    ("bf16 model, fp8 cache", {"kv_cache_dtype": "fp8"}, None),
    ("fp8 weights (rows), bf16 cache", {"quantization": "fp8"}, "rows"),
    ("fp8 weights (128x128 blocks), bf16 cache", {"quantization": "fp8"}, "blocks"),
]
# The tiny checkpoints of tests/conftest.py, and one whose layers all take 128 x 128 blocks (in_features 128, 256)
GPU_CHECKPOINTS = {
    "llama_gqa_untied": None,
    "qwen3": None,
    "llama_h128": ("llama", dict(hidden_size=128, intermediate_size=256, num_key_value_heads=2, head_dim=32)),
    "llama_h512": ("llama", dict(hidden_size=512, intermediate_size=1024, num_key_value_heads=2)),
}


def write_checkpoint(directory: str, name: str) -> None:
    from conftest import TINY_MODELS, write_tiny_model

    if GPU_CHECKPOINTS[name] is not None:
        TINY_MODELS[name] = GPU_CHECKPOINTS[name]
    write_tiny_model(directory, name)


def gap_row(gaps: torch.Tensor) -> dict:
    return {
        "tokens": gaps.numel(),
        "share_gap_0": (gaps == 0).float().mean().item(),
        **{f"p{q}": gaps.quantile(q / 100).item() for q in (50, 90, 99)},
        "max": gaps.max().item(),
    }


def score_runs(name: str, model: str, reference, prompts: list[list[int]], runs: list, new_tokens: int) -> dict:
    """For each run, the gap (best logit - chosen logit) of every greedy token under the float32 reference's
    forward over prompt + output."""
    result = {}
    for label, keywords, scaling in runs:
        os.environ.pop("PAGEDLLM_FP8_SCALING", None)
        if scaling is not None:
            os.environ["PAGEDLLM_FP8_SCALING"] = scaling
        llm = LLM(model, dtype="bfloat16", num_kv_blocks=1024, max_num_seqs=16, **keywords)
        gaps = []
        for prompt, output in zip(prompts, generate(llm, prompts, new_tokens)):
            with torch.no_grad():
                logits = reference(torch.tensor([prompt + output], device="cuda")).logits[0].float()
            rows = logits[len(prompt) - 1 : -1]
            gaps.append(rows.max(-1).values - rows[torch.arange(len(output)), torch.tensor(output)])
        result[f"{name}, {label}"] = gap_row(torch.cat(gaps).cpu())
        llm.shutdown()
        del llm
        torch.cuda.empty_cache()
    return result


def print_gaps(result: dict) -> None:
    print("\n| checkpoint, run | tokens | gap 0 | p50 | p90 | p99 | max |\n|---|---|---|---|---|---|---|")
    for label, row in result.items():
        print(f"| {label} | {row['tokens']} | {row['share_gap_0']:.1%} | {row['p50']:.4f} | {row['p90']:.4f} | "
              f"{row['p99']:.4f} | {row['max']:.4f} |")  # fmt: skip


def gpu_tiny_gaps(args: argparse.Namespace) -> dict:
    """Gap distribution of each generated token under a float32 transformers forward: bf16 against fp8 caches and
    fp8 weights (row and block scaling; blocks only where every in_features divides by 128)."""
    import tempfile

    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import VOCAB_SIZE

    torch.backends.cuda.matmul.allow_tf32 = False  # the float32 reference in float32
    rng = random.Random(0)
    prompts = [[rng.randrange(2, VOCAB_SIZE) for _ in range(n)] for n in (1, 7, 16, 33, 100, 250, 400, 513)]
    result = {}
    for name in GPU_CHECKPOINTS:
        directory = tempfile.mkdtemp(prefix=f"pagedllm-{name}-")
        write_checkpoint(directory, name)
        reference = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).cuda().eval()
        runs = [run for run in GPU_RUNS if run[2] != "blocks" or name == "llama_h512"]
        result.update(score_runs(name, directory, reference, prompts, runs, 16))
    print_gaps(result)
    return result


def gpu_default_gaps(args: argparse.Namespace) -> dict:
    """The default model (its Q4_1 GGUF, dequantized) on CUDA, the chat prompts of the CPU run: bf16 weights with
    bf16 and fp8 caches, and fp8 weights quantized at load (row scaling: its in_features, 576 and 1536, are not
    multiples of 512), each token scored by transformers' float32 forward of the same GGUF."""
    from transformers import AutoModelForCausalLM

    from pagedllm.loader.default_model import default_model_path

    torch.backends.cuda.matmul.allow_tf32 = False
    path = default_model_path()
    reference = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    reference = reference.cuda().eval()
    prompter = LLM(str(path), device="cpu", dtype="float32", num_kv_blocks=16)
    prompts = chat_prompts(prompter, args.num_prompts)
    prompter.shutdown()
    runs = [run for run in GPU_RUNS if run[2] != "blocks"]
    result = score_runs("SmolLM2-135M", str(path), reference, prompts, runs, args.new_tokens)
    print_gaps(result)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--gpu-tiny", action="store_true", help="the tiny checkpoints on CUDA instead (bf16, fp8)")
    parser.add_argument("--gpu-default", action="store_true", help="the default model on CUDA instead (bf16, fp8)")
    args = parser.parse_args()
    if args.gpu_tiny:
        result, name = gpu_tiny_gaps(args), "fp8_accuracy_gpu_tiny.json"
    elif args.gpu_default:
        result, name = gpu_default_gaps(args), "fp8_accuracy_gpu_default.json"
    else:
        result, name = cpu_accuracy(args), "fp8_accuracy.json"
    if os.environ.get("OUT"):
        (Path(os.environ["OUT"]) / name).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
