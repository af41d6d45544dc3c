"""Is a fresh tiny engine's first run slower, and where? The workload and engines of
tests/gpu/test_gpu_first_run.py: three fresh engines' four runs, each beside a run of a warm reference engine (the
host's speed drifts within seconds, so each time is read beside the reference's), then two more fresh engines with
run 0 and run 1 under cProfile and the functions whose time grew most in run 0.

Run on a GPU: python benchmarks/experiments/tiny_first_run_profile.py
"""

from __future__ import annotations

import cProfile
import pstats
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[2] / "tests"))
sys.path.insert(0, str(Path(__file__).parents[2] / "tests" / "gpu"))
sys.path.insert(0, str(Path(__file__).parents[1]))

from conftest import write_tiny_model  # noqa: E402
from first_run_probe import compare_profiles  # noqa: E402
from test_gpu_first_run import SMALL, run, workload  # noqa: E402

from pagedllm import LLM  # noqa: E402


def profiled_run(llm: LLM, prompts: list[dict]) -> dict:
    profiler = cProfile.Profile()
    profiler.enable()
    run(llm, prompts, max_tokens=96)
    profiler.disable()
    return pstats.Stats(profiler).stats


def main() -> None:
    directory = tempfile.mkdtemp()
    write_tiny_model(directory, "llama_gqa_untied")
    prompts = workload(7, 128, (16, 512))
    with LLM(directory, **SMALL) as reference:
        run(reference, prompts, max_tokens=96)
        for engine in range(3):
            with LLM(directory, **SMALL) as llm:
                pairs = []
                for _ in range(4):
                    reference_s = run(reference, prompts, max_tokens=96)
                    pairs.append((run(llm, prompts, max_tokens=96), reference_s))
            print(f"engine {engine}, runs (own s, reference s): " + ", ".join(f"({a:.3f}, {b:.3f})" for a, b in pairs))
    for engine in range(2):
        with LLM(directory, **SMALL) as llm:
            first, second = profiled_run(llm, prompts), profiled_run(llm, prompts)
        print(f"profiled engine {engine}")
        compare_profiles(first, second, top=15)


if __name__ == "__main__":
    main()
