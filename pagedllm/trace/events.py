"""The trace's vocabulary: Chrome/Perfetto trace-event dicts (microsecond timestamps) and where each kind goes.

Process ENGINE holds the host track (schedule, plan, launch, resolve of every step), the device track (forward,
sampling), the steps track (one span per step whose args hold its counts) and the counters; process REQUESTS holds
one track (thread) per request, numbered in arrival order.
"""

from __future__ import annotations

FORMAT = "pagedllm-trace/1"  # otherData["format"]: how readers recognise a pagedllm trace

ENGINE_PID, REQUESTS_PID = 1, 2
HOST_TID, DEVICE_TID, STEPS_TID = 1, 2, 3
HOST_PHASES = ("schedule", "plan", "launch", "resolve")
DEVICE_PHASES = ("forward", "sampling")

# A step span's args, in this order.
STEP_FIELDS = ("step", "seqs", "prefill_tokens", "decode_tokens", "sampled", "generated", "running", "waiting",
               "kv_used", "kv_cached", "kv_free", "preemptions", "prefix_hit_tokens",
               "drafts", "draft_tokens", "accepted_tokens")  # fmt: skip
# The fields a trace written before speculative decoding lacks (readers count them 0).
SPECULATION_FIELDS = ("drafts", "draft_tokens", "accepted_tokens")

# Counter tracks: name -> the step args they plot.
COUNTERS = {
    "requests": ("running", "waiting"),
    "tokens in step": ("prefill_tokens", "decode_tokens"),
    "KV blocks": ("kv_used", "kv_cached", "kv_free"),
    "generated tokens": ("generated",),
    "prefix-cache hit tokens": ("prefix_hit_tokens",),
    "preemptions": ("preemptions",),
    "speculative decoding": ("draft_tokens", "accepted_tokens"),
}

# KV snapshot states, one character per block.
FREE, CACHED, USED, SHARED = ".", "c", "u", "s"  # cached: free but still in the prefix cache; shared: 2+ holders


def microseconds(seconds: float) -> float:
    return round(seconds * 1e6, 1)


def span(name: str, cat: str, pid: int, tid: int, start: float, end: float, args: dict | None = None) -> dict:
    """A complete event ("X") from start to end, in seconds since the trace's origin."""
    event = {"ph": "X", "name": name, "cat": cat, "pid": pid, "tid": tid, "ts": microseconds(start)}
    event["dur"] = max(round(microseconds(end) - event["ts"], 1), 0.0)
    if args:
        event["args"] = args
    return event


def instant(name: str, cat: str, pid: int, tid: int, at: float, args: dict | None = None) -> dict:
    event = {"ph": "i", "s": "t", "name": name, "cat": cat, "pid": pid, "tid": tid, "ts": microseconds(at)}
    if args:
        event["args"] = args
    return event


def counter(name: str, at: float, values: dict[str, float]) -> dict:
    return {"ph": "C", "name": name, "pid": ENGINE_PID, "ts": microseconds(at), "args": values}


def process_name(pid: int, name: str) -> list[dict]:
    return [
        {"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name}},
        {"ph": "M", "name": "process_sort_index", "pid": pid, "args": {"sort_index": pid}},
    ]


def thread_name(pid: int, tid: int, name: str) -> list[dict]:
    """Names a track; tracks are kept in tid order."""
    return [
        {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}},
        {"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "args": {"sort_index": tid}},
    ]
