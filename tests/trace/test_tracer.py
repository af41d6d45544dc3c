"""The trace is valid trace-event JSON whose counters and request tracks agree with what the engine itself reports,
with steps in sync and overlapped (async) order, preemption, aborts and KV snapshots; off, it costs nothing."""

from __future__ import annotations

import json
from collections import Counter, defaultdict

import pytest
from traced_runs import events, shared_prefix_prompts, step_total, traced_generate

from pagedllm import LLM, SamplingParams
from pagedllm.trace.events import CACHED, FREE, HOST_PHASES, SHARED, USED

REQUIRED_KEYS = {"X": {"name", "ts", "dur", "pid", "tid"}, "i": {"name", "ts", "pid", "tid", "s"},
                 "C": {"name", "ts", "pid", "args"}, "M": {"name", "pid", "args"}}  # fmt: skip


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def run(request, llama_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("trace") / "trace.json"
    return traced_generate(llama_dir, path, async_scheduling=request.param, trace_kv_every=2)


def assert_valid_trace_events(trace: dict) -> None:
    """The trace-event format (JSON Object Format): every event has the keys its phase needs, with sane values."""
    json.loads(json.dumps(trace))  # plain JSON types only
    assert isinstance(trace["traceEvents"], list) and trace["traceEvents"]
    for event in trace["traceEvents"]:
        assert REQUIRED_KEYS[event["ph"]] <= event.keys(), event
        if event["ph"] != "M":
            assert isinstance(event["ts"], int | float) and event["ts"] >= 0, event
        if event["ph"] == "X":
            assert event["dur"] >= 0, event


def assert_spans_nest(trace: dict) -> None:
    """On each track, two spans are disjoint or one holds the other (what trace viewers need to draw them)."""
    tracks = defaultdict(list)
    for event in trace["traceEvents"]:
        if event["ph"] == "X":
            tracks[event["pid"], event["tid"]].append((event["ts"], event["ts"] + event["dur"], event["name"]))
    for track, spans in tracks.items():
        spans.sort(key=lambda span: (span[0], -span[1]))
        open_ends: list[float] = []
        for start, end, name in spans:
            while open_ends and open_ends[-1] <= start + 0.2:  # 0.1 us rounding
                open_ends.pop()
            assert not open_ends or end <= open_ends[-1] + 0.2, f"{name} at {start} overlaps on track {track}"
            open_ends.append(end)


def test_trace_is_valid_trace_event_json(run):
    assert_valid_trace_events(run.trace)
    assert_spans_nest(run.trace)
    assert run.trace["otherData"]["num_kv_blocks"] == run.llm.llm_engine.block_manager.num_blocks


def test_one_step_span_per_step_with_its_phases(run):
    steps = events(run.trace, "step")
    assert [e["args"]["step"] for e in steps] == [record.step_id for record in run.records]
    assert [e["args"]["seqs"] for e in steps] == [record.num_seqs for record in run.records]
    host = Counter(e["name"] for e in events(run.trace, "host"))
    assert host == dict.fromkeys(HOST_PHASES, len(steps))
    device = Counter(e["name"] for e in events(run.trace, "device"))  # host clock marks on CPU
    assert device == {"forward": len(steps), "sampling": len(steps)}


def test_token_counters_agree_with_the_outputs(run):
    generated = sum(len(output.outputs[0].token_ids) for output in run.outputs)
    assert step_total(run.trace, "generated") == generated
    assert step_total(run.trace, "sampled") == generated  # no request ended with a step in flight
    # No preemption here: every request decodes all its tokens but the first, which its prompt's last chunk samples.
    assert step_total(run.trace, "preemptions") == 0
    assert step_total(run.trace, "decode_tokens") == generated - len(run.outputs)
    prompt_tokens = sum(len(output.prompt_token_ids) for output in run.outputs)
    assert step_total(run.trace, "prefill_tokens") == prompt_tokens - sum(o.num_cached_tokens for o in run.outputs)


def test_prefix_hits_equal_cached_tokens(run):
    cached = sum(output.num_cached_tokens for output in run.outputs)
    assert cached > 0, "the second pass must hit the prefix cache"
    assert step_total(run.trace, "prefix_hit_tokens") == cached


def test_one_request_track_per_request(run):
    tracks = {e["args"]["request_id"]: e for e in events(run.trace, "request", "request")}
    outputs = {output.request_id: output for output in run.outputs}
    assert tracks.keys() == outputs.keys()
    thread_names = {e["tid"]: e["args"]["name"] for e in run.trace["traceEvents"] if e["name"] == "thread_name"}
    for request_id, track in tracks.items():
        output, info = outputs[request_id], track["args"]
        assert thread_names[track["tid"]] == f"request {request_id}"
        assert info["prompt_tokens"] == len(output.prompt_token_ids)
        assert info["output_tokens"] == len(output.outputs[0].token_ids)
        assert info["cached_tokens"] == output.num_cached_tokens
        assert info["finish_reason"] == output.outputs[0].finish_reason == "length"
        assert 0 <= info["queued_ms"] <= info["time_to_first_token_ms"] <= info["latency_ms"]
        on_track = [e for e in events(run.trace, "request") if e["tid"] == track["tid"]]
        names = [e["name"] for e in sorted(on_track, key=lambda e: e["ts"]) if e["ph"] == "X" and e is not track]
        assert names[0] == "queued" and "prefill" in names
        assert ("decode" in names) == (len(output.outputs[0].token_ids) > 1)
        chunks = sum(e["args"]["tokens"] for e in on_track if e["name"] == "prefill")
        assert chunks == len(output.prompt_token_ids) - output.num_cached_tokens
        for event in on_track:  # every part of the request lies within its span
            assert track["ts"] <= event["ts"] and event["ts"] + event.get("dur", 0) <= track["ts"] + track["dur"] + 0.2


def test_kv_snapshots_agree_with_the_step_counters(run):
    snapshots = events(run.trace, "kv", "KV blocks")
    counters = {e["args"]["step"]: e["args"] for e in events(run.trace, "step")}
    assert [e["args"]["step"] for e in snapshots] == [step for step in counters if step % 2 == 0]
    num_blocks = run.trace["otherData"]["num_kv_blocks"]
    request_tids = {e["tid"] for e in events(run.trace, "request", "request")}
    shared = 0
    for snapshot in snapshots:
        states, owners = snapshot["args"]["states"], snapshot["args"]["owners"]
        assert len(states) == len(owners) == num_blocks and set(states) <= {FREE, CACHED, USED, SHARED}
        in_use = states.count(USED) + states.count(SHARED)
        assert in_use == counters[snapshot["args"]["step"]]["kv_used"]
        for state, owner in zip(states, owners):
            assert (owner in request_tids) if state in (USED, SHARED) else owner == -1
        shared += states.count(SHARED)
    assert shared > 0, "requests with a common prefix run together, so some snapshot shows shared blocks"


def test_preemptions_are_counted_and_drawn(llama_dir, tmp_path):
    run = traced_generate(llama_dir, tmp_path / "trace.json", passes=1, shortest=20, num_kv_blocks=6)
    preemptions = run.llm.llm_engine.scheduler.num_preemptions
    assert preemptions > 0
    assert step_total(run.trace, "preemptions") == preemptions
    assert len(events(run.trace, "request", "preempted")) == preemptions
    assert sum(e["args"]["preemptions"] for e in events(run.trace, "request", "request")) == preemptions
    assert events(run.trace, "request", "recompute") and events(run.trace, "request", "waiting (preempted)")
    assert step_total(run.trace, "generated") == sum(len(o.outputs[0].token_ids) for o in run.outputs)
    assert_spans_nest(run.trace)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_aborts_and_late_stops(llama_dir, tmp_path, async_scheduling):
    """Requests aborted mid-run end their tracks with reason 'abort'; with overlapped steps, a request that stops on
    EOS has one more step in flight whose row is sampled but not generated."""
    llm = LLM(llama_dir, trace_file=str(tmp_path / "trace.json"), async_scheduling=async_scheduling)
    engine = llm.llm_engine
    prompts = shared_prefix_prompts(count=6)
    free_run = llm.generate(prompts[0], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    engine.eos_token_ids = frozenset({free_run[0].outputs[0].token_ids[1]})  # r0 stops early, by EOS
    for index, prompt in enumerate(prompts):
        engine.add_request(f"r{index}", prompt, SamplingParams(temperature=0, max_tokens=6))
    finished = {}
    for _ in range(2):
        finished |= {output.request_id: output for output in engine.step() if output.finished}
    aborted = ("r4", "r5")
    for request_id in aborted:
        engine.abort_request(request_id)
    while engine.has_unfinished_requests():
        finished |= {output.request_id: output for output in engine.step() if output.finished}
    engine.write_trace()
    trace = json.loads((tmp_path / "trace.json").read_text())
    tracks = {e["args"]["request_id"]: e["args"] for e in events(trace, "request", "request")}
    assert tracks.keys() == {free_run[0].request_id, *finished, *aborted}
    assert [tracks[request_id]["finish_reason"] for request_id in aborted] == ["abort", "abort"]
    assert finished["r0"].outputs[0].finish_reason == "stop"
    generated = sum(len(o.outputs[0].token_ids) for o in [*free_run, *finished.values()])
    generated += sum(tracks[request_id]["output_tokens"] for request_id in aborted)
    assert step_total(trace, "generated") == generated
    if async_scheduling:
        assert step_total(trace, "sampled") > generated
    assert_spans_nest(trace)


def test_off_by_default_and_when_stopped(llama_dir, tmp_path):
    llm = LLM(llama_dir)
    engine = llm.llm_engine
    assert engine.tracer is None and engine.pipeline.describe_step is None and not engine.worker.record_events
    records = []
    engine.add_step_listener(records.append)
    llm.generate(shared_prefix_prompts(count=2), use_tqdm=False)
    assert records and all(record.detail is None and record.events is None for record in records)
    tracer = engine.start_trace(str(tmp_path / "trace.json"))
    assert engine.pipeline.describe_step is not None and engine.worker.record_events
    engine.stop_trace()
    assert engine.tracer is None and engine.pipeline.describe_step is None and not engine.worker.record_events
    assert tracer.on_step not in engine.step_listeners
    assert (tmp_path / "trace.json").exists()  # written when stopped


def test_trace_started_mid_run_follows_only_new_requests(llama_dir):
    llm = LLM(llama_dir)
    engine = llm.llm_engine
    prompts = shared_prefix_prompts(count=4)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for index, prompt in enumerate(prompts[:2]):
        engine.add_request(f"early{index}", prompt, params)
    engine.step()
    tracer = engine.start_trace(None)
    engine.add_request("late", prompts[3], params)  # shares the 40-token prefix of early1: a prefix-cache hit
    finished = {}
    while engine.has_unfinished_requests():
        finished |= {output.request_id: output for output in engine.step() if output.finished}
    trace = tracer.trace()
    assert [e["args"]["request_id"] for e in events(trace, "request", "request")] == ["late"]
    assert step_total(trace, "prefix_hit_tokens") == finished["late"].num_cached_tokens > 0
    assert step_total(trace, "generated") == 3 * 6 - 2  # the early requests sampled their first tokens before


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(trace_kv_every=4), "trace_kv_every needs trace_file"),
        (dict(trace_file="/nonexistent/dir/trace.json"), "does not exist"),
        (dict(trace_file="t.json", trace_kv_every=0), "trace_kv_every must be a positive int"),
        (dict(trace_file=""), "trace_file must be a file path"),
    ],
)
def test_bad_trace_options(llama_dir, kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(llama_dir, **kwargs)
