"""--trace-file on `pagedllm generate` (a subprocess, as a user runs it), then `pagedllm trace-summary` on the file."""

from __future__ import annotations

import json
import subprocess
import sys

from pagedllm.entrypoints.cli import main


def test_generate_writes_a_trace_that_trace_summary_reads(llama_dir, tmp_path, capsys):
    trace = tmp_path / "trace.json"
    generate = ["generate", "The quick brown", "Paris is", "--model", llama_dir, "--max-tokens", "5"]
    tracing = ["--trace-file", str(trace), "--trace-kv-every", "1"]
    command = [sys.executable, "-m", "pagedllm.entrypoints.cli", *generate, *tracing]
    result = subprocess.run(command, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr
    requests = [e for e in json.loads(trace.read_text())["traceEvents"] if e["name"] == "request"]
    assert sorted(e["args"]["output_tokens"] for e in requests) == [5, 5]
    plot, picture = tmp_path / "plot.png", tmp_path / "kv.png"
    args = ["trace-summary", str(trace), "--plot", str(plot), "--kv-picture", str(picture), "--step", "2"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "10 tokens generated" in printed and "requests finished: 2 (2 length)" in printed
    assert f"plot written to {plot}" in printed and f"KV picture of step 2 written to {picture}" in printed
    assert plot.stat().st_size > 10_000 and picture.stat().st_size > 10_000


def test_trace_flags_are_checked(llama_dir, capsys):
    assert main(["generate", "x", "--model", llama_dir, "--trace-kv-every", "2"]) == 2
    assert "--trace-kv-every needs --trace-file" in capsys.readouterr().err  # CLI errors name the flag
