"""The CPU attention kernel (attention/cpu_paged_attention.cpp) of two commits in one process, as a decode step
meets it: each commit's source built as its own library (its op namespace renamed), then both timed alternately over
the caches of LAYERS layers in turn, so K and V come from memory as in an engine step rather than from the caches
left warm by the previous call. Rows' visible lengths: the 32 chat prompts of cpu_peers.py (`--lengths chat32`, from
the chat template of the default model), or uniform over [ctx / 2, ctx].

    python benchmarks/experiments/cpu_attention_ab.py --old HEAD~1 [--new WORKTREE] [--threads 2]
        [--lengths chat32|uniform] [--rows 32] [--ctx 600] [--layers 30] [--rounds 10]

Prints each commit's median time a layer, the K/V bytes it read per second, the paired speedup, and the largest
difference between the two outputs.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("pagedllm/attention/cpu_paged_attention.cpp", "pagedllm/cpu_kernels.h", "pagedllm/cpu_vector_math.h")


def source_of(commit: str, path: str) -> str:
    if commit == "WORKTREE":
        return (ROOT / path).read_text()
    return subprocess.run(["git", "show", f"{commit}:{path}"], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout  # fmt: skip


def build_ops(commit: str, tag: str, into: Path, sources: tuple[str, ...] = SOURCES):
    """The commit's sources (the first compiled, the others its headers) as a library whose op namespace is
    pagedllm_ab_<tag> instead of pagedllm_cpu, so two commits' kernels load side by side; returns that namespace."""
    from torch.utils import cpp_extension

    from pagedllm.cpu_kernels import compiler_flags

    namespace = f"pagedllm_ab_{tag}"
    folder = into / tag
    folder.mkdir()
    for path in sources:
        (folder / Path(path).name).write_text(re.sub(r"\bpagedllm_cpu\b", namespace, source_of(commit, path)))
    name = f"{namespace}_{abs(hash((commit, sources))) % 10**8}"
    cpp_extension.load(
        name=name,
        sources=[str(folder / Path(sources[0]).name)],
        extra_cflags=compiler_flags(),
        extra_include_paths=[str(folder)],
        extra_ldflags=["-fopenmp"],
        is_python_module=False,
    )
    return getattr(torch.ops, namespace)


def build(commit: str, tag: str, into: Path):
    """The commit's attention kernel; returns its paged_attention_rows op."""
    return build_ops(commit, tag, into).paged_attention_rows.default


def chat32_lengths() -> list[int]:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from cpu_generate import chat_prompts

    from pagedllm.llm import LLM

    llm = LLM()
    return [len(ids) + 8 for ids in chat_prompts(llm, 32)]  # 8 tokens into their answers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", required=True)
    parser.add_argument("--new", default="WORKTREE")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--lengths", choices=("chat32", "uniform"), default="chat32")
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--ctx", type=int, default=600)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    heads, kv_heads, head_dim, block_size = 9, 3, 64, 16  # the default model's attention
    torch.manual_seed(0)
    if args.lengths == "chat32":
        lengths = chat32_lengths()
    else:
        lengths = torch.randint(args.ctx // 2, args.ctx + 1, (args.rows,)).tolist()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as into:
        ops = {"old": build(args.old, "old", Path(into)), "new": build(args.new, "new", Path(into))}
    rows, width = len(lengths), -(-max(lengths) // block_size)
    num_blocks = rows * width
    shape = (num_blocks, block_size, kv_heads, head_dim)
    caches = [(torch.randn(shape), torch.randn(shape)) for _ in range(args.layers)]
    tables = torch.randperm(num_blocks).view(rows, width).int()
    query, visible = torch.randn(rows, heads, head_dim), torch.tensor(lengths, dtype=torch.int32)
    scale = head_dim**-0.5
    outputs = {name: op(query, *caches[0], tables, None, visible, scale, None, None) for name, op in ops.items()}
    times = {name: [] for name in ops}
    for _ in range(args.rounds):
        for name, op in ops.items():
            start = time.perf_counter()
            for k_cache, v_cache in caches:
                op(query, k_cache, v_cache, tables, None, visible, scale, None, None)
            times[name].append((time.perf_counter() - start) / args.layers)
    kv_bytes = sum(lengths) * kv_heads * head_dim * 2 * 4
    print(f"{rows} rows, {sum(lengths)} keys in all ({min(lengths)}..{max(lengths)}), {args.threads} threads, "
          f"{args.layers} layers' caches in turn")  # fmt: skip
    for name, commit in (("old", args.old), ("new", args.new)):
        median = statistics.median(times[name])
        print(f"{name} ({commit}): {median * 1e3:.2f} ms a layer, {kv_bytes / median / 1e9:.1f} GB/s of K/V")
    speedup = statistics.median(old / new for old, new in zip(times["old"], times["new"]))
    difference = (outputs["new"] - outputs["old"]).abs().max().item()
    print(f"new against old: {speedup:.2f}x (median of paired rounds); largest output difference {difference:.1e}")


if __name__ == "__main__":
    main()
