"""A trace in a few numbers: steps, time per phase, batch size, KV peak, prefix-cache hits, preemptions, and
per-request queueing, time to first token and latency percentiles."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

from pagedllm.trace.events import DEVICE_PHASES, HOST_PHASES, SPECULATION_FIELDS
from pagedllm.trace.reader import Trace

PERCENTILES = (50, 90, 99, 100)
REQUEST_TIMES = {"queued": "queued_ms", "time to first token": "time_to_first_token_ms", "latency": "latency_ms"}


@dataclass(slots=True)
class Summary:
    num_steps: int
    busy_seconds: float  # from the first step's start to the last step's end
    phase_seconds: dict[str, float]
    mean_seqs_per_step: float
    mean_tokens_per_step: float
    prefill_tokens: int
    decode_tokens: int
    generated_tokens: int
    num_kv_blocks: int
    peak_kv_used_blocks: int
    preemptions: int
    num_requests: int
    finish_reasons: dict[str, int]
    prompt_tokens: int
    cached_tokens: int  # prompt tokens found in the prefix cache at first admission
    request_ms: dict[str, list[float]]  # "queued" / "time to first token" / "latency" -> the PERCENTILES, in ms
    # Speculative decoding (spec_decode/metrics.py's figures; 0 without it, and in traces from before it).
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0

    @property
    def prefix_hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def summarize(trace: Trace) -> Summary:
    steps, requests = trace.steps, [request.info for request in trace.requests]
    if not steps:
        raise ValueError("the trace holds no steps: nothing ran while it was recorded")

    def total(key: str) -> int:
        return sum(step.counts[key] for step in steps)

    request_ms = {}
    for name, key in REQUEST_TIMES.items():
        values = [info[key] for info in requests if info[key] is not None]
        request_ms[name] = [float(v) for v in np.percentile(values, PERCENTILES)] if values else []
    return Summary(
        num_steps=len(steps),
        busy_seconds=steps[-1].end - steps[0].start,
        phase_seconds=dict(trace.phase_seconds),
        mean_seqs_per_step=total("seqs") / len(steps),
        mean_tokens_per_step=(total("prefill_tokens") + total("decode_tokens")) / len(steps),
        prefill_tokens=total("prefill_tokens"),
        decode_tokens=total("decode_tokens"),
        generated_tokens=total("generated"),
        num_kv_blocks=trace.metadata["num_kv_blocks"],
        peak_kv_used_blocks=max(step.counts["kv_used"] for step in steps),
        preemptions=total("preemptions"),
        num_requests=len(requests),
        finish_reasons=dict(Counter(info["finish_reason"] for info in requests)),
        prompt_tokens=sum(info["prompt_tokens"] for info in requests),
        cached_tokens=sum(info["cached_tokens"] for info in requests),
        request_ms=request_ms,
        **{name: sum(step.counts.get(name, 0) for step in steps) for name in SPECULATION_FIELDS},
    )


def format_summary(summary: Summary) -> str:
    busy = max(summary.busy_seconds, 1e-9)
    reasons = ", ".join(f"{count} {reason}" for reason, count in sorted(summary.finish_reasons.items()))
    reasons = f" ({reasons})" if reasons else ""
    lines = [
        f"{summary.num_steps} steps in {busy:.3f} s, {summary.generated_tokens} tokens generated "
        f"({summary.generated_tokens / busy:.1f} tokens/s); requests finished: {summary.num_requests}{reasons}",
        "time by phase: host " + phase_shares(summary.phase_seconds, HOST_PHASES, busy),
    ]
    if any(summary.phase_seconds[name] for name in DEVICE_PHASES):
        lines.append("               device " + phase_shares(summary.phase_seconds, DEVICE_PHASES, busy))
    peak, blocks = summary.peak_kv_used_blocks, summary.num_kv_blocks
    lines += [
        f"batch: {summary.mean_seqs_per_step:.2f} sequences, {summary.mean_tokens_per_step:.1f} tokens per step "
        f"(in all {summary.prefill_tokens} prefill and {summary.decode_tokens} decode tokens)",
        f"KV cache: peak {peak} of {blocks} blocks in use ({100 * peak / blocks:.1f}%)",
        f"prefix cache: {summary.cached_tokens} of {summary.prompt_tokens} prompt tokens hit "
        f"({100 * summary.prefix_hit_rate:.1f}%)",
        f"preemptions: {summary.preemptions}",
        *speculation_lines(summary),
        "per request (ms)     " + "".join(f"{'max' if p == 100 else f'p{p}':>10}" for p in PERCENTILES),
    ]
    for name, values in summary.request_ms.items():
        lines.append(f"  {name:<19}" + ("".join(f"{value:10.1f}" for value in values) or "   (none)"))
    return "\n".join(lines)


def speculation_lines(summary: Summary) -> list[str]:
    """The acceptance rate (accepted / draft tokens) and the mean accepted length (tokens a verify step yields for a
    sequence: its accepted drafts and one more), where drafts were verified."""
    if not summary.drafts:
        return []
    rate, length = summary.accepted_tokens / summary.draft_tokens, 1 + summary.accepted_tokens / summary.drafts
    return [
        f"speculative decoding: {summary.draft_tokens} draft tokens in {summary.drafts} verifies, "
        f"{summary.accepted_tokens} accepted ({100 * rate:.1f}%), mean accepted length {length:.2f}"
    ]


def phase_shares(phase_seconds: dict[str, float], names: tuple[str, ...], busy: float) -> str:
    return "  ".join(f"{name} {phase_seconds[name]:.3f} s ({100 * phase_seconds[name] / busy:.1f}%)" for name in names)
