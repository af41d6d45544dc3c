"""Read a pagedllm trace back into plain rows: steps, time per phase, requests and KV-block snapshots."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from pagedllm.trace.events import DEVICE_PHASES, ENGINE_PID, FORMAT, HOST_PHASES, REQUESTS_PID


@dataclass(slots=True)
class StepRow:
    start: float  # seconds since the trace's origin
    end: float
    counts: dict[str, int]  # the step span's args: seqs, prefill_tokens, generated, kv_used, ... (tracer.on_step)


@dataclass(slots=True)
class RequestRow:
    arrived: float  # seconds since the trace's origin
    finished: float
    info: dict  # the request span's args: request_id, prompt_tokens, output_tokens, latency_ms, ... (tracer)


@dataclass(slots=True)
class KvSnapshot:
    step: int
    states: str  # one events.FREE / CACHED / USED / SHARED per block
    owners: list[int]  # request track id per block (-1: none)


@dataclass(slots=True)
class Trace:
    metadata: dict  # otherData: num_kv_blocks, block_size, model, ...
    steps: list[StepRow] = field(default_factory=list)
    phase_seconds: dict[str, float] = field(default_factory=dict)  # host and device phases, summed
    requests: list[RequestRow] = field(default_factory=list)  # finished requests, in arrival order
    kv_snapshots: dict[int, KvSnapshot] = field(default_factory=dict)  # by step id
    request_names: dict[int, str] = field(default_factory=dict)  # request track id -> request id


def load_trace(path: str) -> Trace:
    """Raises ValueError when the file is unreadable or not a trace that pagedllm wrote."""
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"cannot read trace {path!r}: {error}") from None
    return parse_trace(data, source=path)


def parse_trace(data: dict, source: str = "trace") -> Trace:
    if not isinstance(data, dict) or data.get("otherData", {}).get("format") != FORMAT:
        raise ValueError(f"{source} is not a pagedllm trace (written with trace_file / --trace-file)")
    trace = Trace(metadata=data["otherData"], phase_seconds=dict.fromkeys(HOST_PHASES + DEVICE_PHASES, 0.0))
    for event in data["traceEvents"]:
        kind, cat = event["ph"], event.get("cat")
        if kind == "X" and cat in ("host", "device"):
            trace.phase_seconds[event["name"]] += event["dur"] / 1e6
        elif kind == "X" and cat == "step":
            trace.steps.append(StepRow(event["ts"] / 1e6, (event["ts"] + event["dur"]) / 1e6, event["args"]))
        elif kind == "X" and cat == "request" and event["name"] == "request":
            start = event["ts"] / 1e6
            trace.requests.append(RequestRow(start, start + event["dur"] / 1e6, event["args"]))
        elif kind == "i" and cat == "kv" and event["pid"] == ENGINE_PID:
            args = event["args"]
            trace.kv_snapshots[args["step"]] = KvSnapshot(args["step"], args["states"], args["owners"])
        elif kind == "M" and event["name"] == "thread_name" and event["pid"] == REQUESTS_PID:
            trace.request_names[event["tid"]] = event["args"]["name"].removeprefix("request ")
    trace.steps.sort(key=lambda step: step.start)
    trace.requests.sort(key=lambda request: request.arrived)
    return trace
