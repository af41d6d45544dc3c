"""trace-summary's numbers equal what the engine reported while the trace was recorded."""

from __future__ import annotations

import statistics

import pytest
from traced_runs import traced_generate

from pagedllm.entrypoints.cli import main
from pagedllm.trace.reader import load_trace, parse_trace
from pagedllm.trace.summary import format_summary, summarize


@pytest.fixture(scope="module")
def run(llama_dir, tmp_path_factory):
    """Two passes (prefix hits) on a KV cache small enough to preempt."""
    path = tmp_path_factory.mktemp("summary") / "trace.json"
    return traced_generate(llama_dir, path, shortest=12, num_kv_blocks=8)


def test_summary_numbers_match_the_engine(run):
    summary = summarize(load_trace(str(run.path)))
    records, engine = run.records, run.llm.llm_engine
    assert summary.num_steps == len(records)
    assert summary.busy_seconds == pytest.approx(records[-1].resolved_at - records[0].scheduled_at, abs=1e-5)
    assert summary.generated_tokens == sum(len(output.outputs[0].token_ids) for output in run.outputs)
    assert summary.prefill_tokens == sum(record.num_prefill_tokens for record in records)
    assert summary.decode_tokens == sum(record.num_decode_tokens for record in records)
    assert summary.mean_seqs_per_step == pytest.approx(statistics.mean(record.num_seqs for record in records))
    num_blocks = engine.block_manager.num_blocks
    assert summary.num_kv_blocks == num_blocks
    assert summary.peak_kv_used_blocks == max(num_blocks - record.num_free_blocks for record in records)
    assert summary.preemptions == engine.scheduler.num_preemptions > 0
    assert summary.num_requests == len(run.outputs)
    assert summary.finish_reasons == {"length": len(run.outputs)}
    assert summary.prompt_tokens == sum(len(output.prompt_token_ids) for output in run.outputs)
    assert summary.cached_tokens == sum(output.num_cached_tokens for output in run.outputs) > 0
    schedule_s = sum(record.batched_at - record.scheduled_at for record in records)
    assert summary.phase_seconds["schedule"] == pytest.approx(schedule_s, abs=1e-6 * len(records))
    launch_s = sum(record.launched_at - record.planned_at for record in records)
    assert summary.phase_seconds["launch"] == pytest.approx(launch_s, abs=1e-6 * len(records))
    for values in summary.request_ms.values():
        assert len(values) == 4 and values == sorted(values)
    assert summary.request_ms["latency"][-1] <= 1e3 * summary.busy_seconds + 50  # arrival precedes the first step


def test_printed_summary(run, capsys):
    assert main(["trace-summary", str(run.path)]) == 0
    printed = capsys.readouterr().out
    summary = summarize(load_trace(str(run.path)))
    assert printed.strip() == format_summary(summary)
    assert printed.startswith(f"{len(run.records)} steps in ")
    assert f"requests finished: {summary.num_requests} ({summary.num_requests} length)" in printed
    assert f"peak {summary.peak_kv_used_blocks} of {summary.num_kv_blocks} blocks in use" in printed
    assert f"prefix cache: {summary.cached_tokens} of {summary.prompt_tokens} prompt tokens hit" in printed
    assert f"preemptions: {run.llm.llm_engine.scheduler.num_preemptions}\n" in printed
    latency_line = next(line for line in printed.splitlines() if line.strip().startswith("latency"))
    assert [float(value) for value in latency_line.split()[1:]] == pytest.approx(summary.request_ms["latency"], abs=0.1)


@pytest.mark.parametrize(
    ("content", "args", "message"),
    [
        ("not json", [], "cannot read trace"),
        ('{"traceEvents": []}', [], "not a pagedllm trace"),
        (None, ["--step", "3"], "--step picks the step of --kv-picture"),
        (None, ["--kv-picture", "k.png"], "no KV block snapshots"),  # refused before anything is written
    ],
)
def test_bad_traces_and_flags(run, tmp_path, capsys, content, args, message):
    path = run.path
    if content is not None:
        path = tmp_path / "bad.json"
        path.write_text(content)
    assert main(["trace-summary", str(path), *args]) == 2
    assert message in capsys.readouterr().err


def test_summary_needs_steps():
    empty = {"traceEvents": [], "otherData": {"format": "pagedllm-trace/1", "num_kv_blocks": 4}}
    with pytest.raises(ValueError, match="holds no steps"):
        summarize(parse_trace(empty))


def test_speculative_decoding_figures_in_the_trace_and_its_summary(llama_dir, tmp_path):
    """The n-gram drafts, their tokens and the accepted ones, per step in the trace and summed by trace-summary, as
    the engine counted them (vLLM's names and figures: acceptance rate, mean accepted length)."""
    speculative = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    run = traced_generate(llama_dir, tmp_path / "trace.json", passes=1, shortest=16, speculative_config=speculative)
    stats = run.llm.llm_engine.spec_decode_stats
    summary = summarize(load_trace(str(run.path)))
    assert (summary.drafts, summary.draft_tokens, summary.accepted_tokens) == (
        stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens
    )  # fmt: skip
    assert stats.num_draft_tokens > 0 and stats.num_drafts == sum(record.num_drafts for record in run.records)
    assert (f"speculative decoding: {stats.num_draft_tokens} draft tokens in {stats.num_drafts} verifies, "
            f"{stats.num_accepted_tokens} accepted ({100 * stats.acceptance_rate:.1f}%), mean accepted length "
            f"{stats.mean_accepted_length:.2f}") in format_summary(summary)  # fmt: skip
