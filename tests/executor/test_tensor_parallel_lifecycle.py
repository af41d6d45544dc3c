"""Tensor-parallel ranks start only when they can work, and end with the LLM: shutdown(), a `with` block, interpreter
exit, a killed rank, or an error in any rank while it loads or runs. After a failure the main process raises within
seconds, and no process is left behind. Also: the same engine launched by torchrun, and engines side by side."""

from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.entrypoints.openai.async_engine import AsyncLLM
from pagedllm.executor.worker import Worker

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": list(range(5, 5 + length))} for length in (3, 17, 40)]
RAISES_WITHIN_S = 20  # the failures below are seen in well under a second; this leaves room for a loaded machine

# Run by the subprocess tests. The spawned ranks import it as their main module, with the environment of the moment
# they were started: TP_TEST_FAULT makes rank 1 (and only it: rank 0 imported this before setting it) fail.
SCRIPT = textwrap.dedent(
    """
    import json, os, sys, time
    import pagedllm.executor.start_up as start_up
    import pagedllm.executor.worker as worker_module
    from pagedllm import LLM, SamplingParams

    def fail_on_rank_1(what):
        raise ValueError(f"injected failure on rank 1 while {what}")

    if os.environ.get("TP_TEST_FAULT") == "loading":
        start_up.load_weights = lambda *args: fail_on_rank_1("loading")
    if os.environ.get("TP_TEST_FAULT") == "running":
        execute = worker_module.Worker.execute
        worker_module.Worker.execute = lambda self, plan, previous=None, masks=None: (
            fail_on_rank_1("running") if plan.step_id >= 2 else execute(self, plan, previous, masks)
        )

    if __name__ == "__main__":
        model, mode = sys.argv[1], sys.argv[2]
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        prompts = [{"prompt_token_ids": list(range(5, 5 + length))} for length in (3, 17, 40)]
        report = {}
        for fault in ["loading", "running"] if mode == "faults" else [None]:
            os.environ["TP_TEST_FAULT"] = fault or ""
            start = time.monotonic()
            try:
                llm = LLM(model, tensor_parallel_size=2)
                report["pids"] = [process.pid for process in llm.llm_engine.worker.ranks.processes]
                start = time.monotonic()  # a failure while running: timed from the call that meets it
                report["tokens"] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            except RuntimeError as error:
                report[fault] = {"error": str(error), "seconds": time.monotonic() - start}
        print(json.dumps(report), flush=True)
        # exits without shutdown(): interpreter exit must end the ranks
    """
)


def greedy(llm: LLM) -> list[list[int]]:
    return [output.outputs[0].token_ids for output in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def is_running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as status:
            return "zombie" not in status.read()
    except FileNotFoundError:
        return False


def child_pids(pid: int) -> list[int]:
    children = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            if f"\nPPid:\t{pid}\n" in status.read_text():
                children.append(int(status.parent.name))
        except OSError:  # ended while we looked
            pass
    return children


def assert_gone(pids: list[int], within_s: float = 10.0) -> None:
    deadline = time.monotonic() + within_s
    for pid in pids:
        while is_running(pid):
            assert time.monotonic() < deadline, f"rank process {pid} is still running"
            time.sleep(0.05)


def run_env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PAGEDLLM_LOG_LEVEL="WARNING")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.getcwd(), env.get("PYTHONPATH")]))
    return env


@pytest.fixture(scope="module", autouse=True)
def subprocesses(llama_dir, tmp_path_factory):
    """Started at once and awaited by the tests below, so they run side by side (and beside this process's
    engines): rank 1 failing while it loads and while it runs, an LLM left to interpreter exit, and torchrun."""
    script = tmp_path_factory.mktemp("tp-scripts") / "tp_script.py"
    script.write_text(SCRIPT)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                "-m", "pagedllm.entrypoints.cli", "generate", "The quick brown", "Paris is", "--model", llama_dir,
                "--max-tokens", "8", "--threads", "1", "--tensor-parallel-size", "2"]  # fmt: skip
    commands = {
        "faults": [sys.executable, str(script), llama_dir, "faults"],
        "exit-without-shutdown": [sys.executable, str(script), llama_dir, "exit-without-shutdown"],
        "torchrun": torchrun,
    }
    processes = {
        name: subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=run_env(), start_new_session=True
        )
        for name, command in commands.items()
    }
    yield processes
    # Each command's whole process group: a rank or torchrun's workers, still holding the pipes, would otherwise keep
    # communicate() waiting when the test that finishes the command did not run (-k, a failure before it).
    for process in processes.values():
        with contextlib.suppress(ProcessLookupError):  # the group ended with the test that finished it
            os.killpg(process.pid, signal.SIGKILL)
        process.communicate()


def finish(process: subprocess.Popen) -> str:
    stdout, stderr = process.communicate(timeout=300)
    assert process.returncode == 0, stderr[-3000:]
    return stdout


@pytest.fixture(scope="module")
def expected_tokens(llama_dir) -> list[list[int]]:
    return greedy(LLM(llama_dir))


def test_impossible_settings_raise_before_any_process_starts(llama_dir, monkeypatch):
    with pytest.raises(ValueError, match="num_attention_heads=4 is not divisible by tensor_parallel_size=3"):
        LLM(llama_dir, tensor_parallel_size=3)
    with monkeypatch.context() as patch:
        patch.setattr(torch.distributed, "is_gloo_available", lambda: False)
        with pytest.raises(ValueError, match="tensor_parallel_size=2 on cpu needs torch.distributed with gloo"):
            LLM(llama_dir, tensor_parallel_size=2)
    with monkeypatch.context() as patch:  # one GPU that has NCCL
        patch.setattr(torch.cuda, "is_available", lambda: True)
        patch.setattr(torch.cuda, "device_count", lambda: 1)
        patch.setattr(torch.distributed, "is_nccl_available", lambda: True)
        with pytest.raises(ValueError, match="tensor_parallel_size=2 needs 2 GPUs on this host .* torch sees 1"):
            LLM(llama_dir, tensor_parallel_size=2, device="cuda")
    with monkeypatch.context() as patch:
        patch.setenv("RANK", "0")
        patch.setenv("WORLD_SIZE", "4")
        with pytest.raises(ValueError, match="torchrun started 4 processes but tensor_parallel_size=2"):
            LLM(llama_dir, tensor_parallel_size=2)
    assert multiprocessing.active_children() == []


def test_with_block_and_shutdown_end_every_rank(llama_dir, expected_tokens):
    with LLM(llama_dir, tensor_parallel_size=2) as llm:
        assert greedy(llm) == expected_tokens
        processes = llm.llm_engine.worker.ranks.processes
        assert all(process.is_alive() for process in processes)
        start = time.monotonic()
    assert time.monotonic() - start < RAISES_WITHIN_S
    assert [process.exitcode for process in processes] == [0]  # asked to stop, not killed
    llm.shutdown()  # again: nothing left to do
    with pytest.raises(RuntimeError, match="ended"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)


def test_a_killed_rank_is_reported_at_once(llama_dir, expected_tokens):
    llm = LLM(llama_dir, tensor_parallel_size=2)
    assert greedy(llm) == expected_tokens
    (process,) = llm.llm_engine.worker.ranks.processes
    os.kill(process.pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=f"tensor-parallel rank 1 \\(pid {process.pid}\\) exited with code -9"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert time.monotonic() - start < RAISES_WITHIN_S
    with pytest.raises(RuntimeError, match="ended"):  # and stays ended
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert multiprocessing.active_children() == []


def test_an_error_in_rank_0_forward_stops_the_other_ranks(llama_dir, monkeypatch):
    llm = LLM(llama_dir, tensor_parallel_size=2)
    (process,) = llm.llm_engine.worker.ranks.processes
    execute = Worker.execute

    def execute_or_fail(self, plan, previous=None, masks=None):  # patched in this process only: rank 0
        if plan.step_id >= 2:
            raise ValueError("injected failure on rank 0")
        return execute(self, plan, previous, masks)

    monkeypatch.setattr(Worker, "execute", execute_or_fail)
    start = time.monotonic()
    with pytest.raises(ValueError, match="injected failure on rank 0"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert time.monotonic() - start < RAISES_WITHIN_S
    assert not process.is_alive()
    assert multiprocessing.active_children() == []


def test_async_llm_runs_the_ranks_from_its_engine_process(llama_dir, expected_tokens):
    """AsyncLLM's engine core is a process of its own, which starts the ranks (so it must not be daemonic)."""

    async def generate(llm: AsyncLLM) -> list[int]:
        outputs = [output async for output in llm.generate(PROMPTS[1], GREEDY)]
        return outputs[-1].outputs[0].token_ids

    with AsyncLLM(llama_dir, tensor_parallel_size=2) as llm:
        assert asyncio.run(generate(llm)) == expected_tokens[1]
        ranks = child_pids(llm.core.pid)
        assert ranks  # rank 1 (the core is rank 0)
    assert not llm.core.is_alive()
    assert_gone(ranks)


def test_errors_of_rank_1_loading_or_running_are_raised_by_rank_0(subprocesses):
    report = json.loads(finish(subprocesses["faults"]).splitlines()[-1])
    for fault in ("loading", "running"):
        assert "tensor-parallel rank 1" in report[fault]["error"], fault
        assert f"ValueError: injected failure on rank 1 while {fault}" in report[fault]["error"]
    assert report["running"]["seconds"] < RAISES_WITHIN_S  # from generate(); the loading failure's includes starting
    assert_gone(report["pids"])  # of the engine that failed running


def test_interpreter_exit_ends_every_rank(subprocesses, expected_tokens):
    report = json.loads(finish(subprocesses["exit-without-shutdown"]).splitlines()[-1])
    assert report["tokens"] == expected_tokens  # ran beside the other engines of this module: no port collided
    assert_gone(report["pids"])


def test_torchrun_launch_gives_the_one_rank_answer(subprocesses, llama_dir):
    params = SamplingParams(temperature=0, max_tokens=8)
    outputs = LLM(llama_dir).generate(["The quick brown", "Paris is"], params, use_tqdm=False)
    stdout = finish(subprocesses["torchrun"])
    for index, output in enumerate(outputs):
        expected = f"--- [{index}] {output.prompt}\n{output.outputs[0].text}\n"
        assert expected.replace("\r\n", "\n").replace("\r", "\n") in stdout  # as text mode reads it
