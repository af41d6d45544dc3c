"""Does a short idle period slow the next run of a small workload on the GPU (clocks ramping down while idle)?
Builds two engines as tests/gpu/test_gpu_first_run.py does, then times the second engine's runs: back to back, after
2 s idle, and after 2 s idle followed by a one-prompt request. Prints each run with the SM clock read just before it.

Run on a GPU: python benchmarks/experiments/idle_then_run.py
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[2] / "tests"))
sys.path.insert(0, str(Path(__file__).parents[2] / "tests" / "gpu"))

from conftest import write_tiny_model  # noqa: E402
from test_gpu_first_run import SMALL, run, workload  # noqa: E402

from pagedllm import LLM  # noqa: E402


def sm_clock() -> str:
    query = ["nvidia-smi", "--query-gpu=clocks.sm", "--format=csv,noheader"]
    return subprocess.run(query, capture_output=True, text=True).stdout.strip()


def main() -> None:
    directory = Path(tempfile.mkdtemp())
    write_tiny_model(directory, "llama_gqa_untied")
    prompts = workload(7, 128, (16, 512))
    first_engine = LLM(str(directory), **SMALL)
    run(first_engine, prompts[:4], max_tokens=4)
    first_engine.shutdown()
    llm = LLM(str(directory), **SMALL)
    clock = sm_clock()
    print(f"first run: {run(llm, prompts, max_tokens=96):.3f} s (SM clock before: {clock})")
    for label, idle, nudge in [("back to back", 0, False), ("after 2 s idle", 2, False),
                               ("after 2 s idle and a 1-prompt request", 2, True)]:  # fmt: skip
        for _ in range(3):
            time.sleep(idle)
            if nudge:
                run(llm, prompts[:1], max_tokens=2)
            clock = sm_clock()
            print(f"{label}: {run(llm, prompts, max_tokens=96):.3f} s (SM clock before: {clock})")


if __name__ == "__main__":
    main()
