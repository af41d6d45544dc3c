"""`pagedllm bench` on a CPU: nano-vllm's workload scaled down, beside a roofline from the CPU's measured matmul rate
and memory bandwidth. A tiny shape stands in for the published ones, so the run takes seconds."""

from __future__ import annotations

import json

import pytest

TINY_SHAPE = dict(
    model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=10240, rope_theta=10000.0, tie_word_embeddings=True,
    max_position_embeddings=4096,
)  # fmt: skip


def test_bench_on_a_cpu(tmp_path, monkeypatch, capsys):
    from pagedllm.entrypoints import bench_common
    from pagedllm.entrypoints.cli import main

    monkeypatch.setitem(bench_common.SHAPES, "tiny", TINY_SHAPE)
    output = tmp_path / "result.json"
    args = ["bench", "--device", "cpu", "--shape", "tiny", "--scale", "0.03", "--repeats", "2",
            "--checkpoint-dir", str(tmp_path), "--output", str(output)]  # fmt: skip
    assert main(args) == 0
    result = json.loads(output.read_text())
    assert result["workload"]["sequences"] == 8  # 0.03 x 256
    assert result["dtype"] == "float32" and result["threads"] >= 1 and result["cpu"]
    assert result["matmul_tflops"] > 0 and result["read_tb_per_s"] > 0
    assert result["median"]["output_tokens"] == result["workload"]["output_tokens"]
    assert 0 < result["percent_of_roofline"] <= 100
    printed = capsys.readouterr().out
    assert "workload: nano-vllm's x0.03: 8 sequences" in printed and "| roofline |" in printed
    assert "GFLOP/s, memory read" in printed


@pytest.mark.parametrize("flag", ["--latency", "--profile"])
def test_bench_gpu_only_modes_on_a_cpu_say_so(flag, capsys):
    from pagedllm.entrypoints.cli import main

    assert main(["bench", "--device", "cpu", flag]) == 2
    assert f"bench {flag} measures a CUDA GPU" in capsys.readouterr().err
