"""Tracer: follows the engine step by step and request by request, and keeps what it saw as a Chrome/Perfetto trace
(trace-event JSON: open it in ui.perfetto.dev or chrome://tracing). LLMEngine.start_trace attaches one.
"""

from __future__ import annotations

import atexit
import json
import os
import time
from dataclasses import dataclass
from typing import Protocol

import torch

from pagedllm.executor.step_output import HostMark
from pagedllm.logger import logger
from pagedllm.scheduler.scheduler import ScheduledBatch, Scheduler
from pagedllm.scheduler.sequence import Sequence, SequenceStatus
from pagedllm.trace.events import (
    CACHED,
    COUNTERS,
    DEVICE_PHASES,
    DEVICE_TID,
    ENGINE_PID,
    FORMAT,
    FREE,
    HOST_PHASES,
    HOST_TID,
    REQUESTS_PID,
    SHARED,
    STEP_FIELDS,
    STEPS_TID,
    USED,
    counter,
    instant,
    process_name,
    span,
    thread_name,
)
from pagedllm.trace.step_record import KvBlocks, StepDetail, StepRecord


class LaunchedStepView(Protocol):
    """What describe_step reads of a step the pipeline has just launched (engine.step_pipeline.LaunchedStep)."""

    batch: ScheduledBatch
    record: StepRecord


@dataclass(slots=True)
class TracedStep:
    """One step as on_step saw it, turned into events only when the trace is asked for (off the hot path)."""

    start: float  # time.perf_counter(), as every time here
    end: float
    host_times: tuple[float, ...]  # scheduled, batched, planned, launched, resolve started, resolved
    device_times: tuple[float, float, float] | None  # start, forward done, end (on the host clock)
    counts: tuple[int, ...]  # values of events.STEP_FIELDS


@dataclass(slots=True)
class RequestTrack:
    tid: int
    request_id: str
    arrived_at: float  # seconds since the trace's origin, as every time below
    open_span: str | None  # the span running since open_since, drawn when it closes
    open_since: float
    last_end: float  # end of the latest span drawn on this track
    admitted_at: float | None = None
    first_token_at: float | None = None
    num_preemptions: int = 0


class DeviceClock:
    """Puts device marks on the host clock: a CUDA event by its distance from a reference event recorded on an idle
    device at a known host time; a HostMark is a host time already."""

    def __init__(self, device: torch.device):
        self.reference: torch.cuda.Event | None = None
        self.reference_time = 0.0
        if device.type == "cuda":
            with torch.cuda.device(device):
                torch.cuda.synchronize()
                self.reference = torch.cuda.Event(enable_timing=True)
                self.reference.record()
                self.reference.synchronize()
                self.reference_time = time.perf_counter()

    def host_time(self, mark: torch.cuda.Event | HostMark) -> float:
        if isinstance(mark, HostMark):
            return mark.time
        assert self.reference is not None, "a CUDA event on a tracer made for another device"
        return self.reference_time + self.reference.elapsed_time(mark) / 1e3


class Tracer:
    """A step listener plus request hooks (arrived, finished) and the pipeline's describe_step.

    path: written by save() (LLM.generate calls it when it returns) and at exit; None keeps the trace in memory.
    kv_every: snapshot the KV block pool every this many steps (for trace-summary --kv-picture); None: never.
    """

    def __init__(
        self,
        path: str | None,
        device: torch.device,
        num_kv_blocks: int,
        kv_every: int | None = None,
        metadata: dict | None = None,
    ):
        self.path = path
        self.num_kv_blocks = num_kv_blocks
        self.kv_every = kv_every
        self.metadata = {"format": FORMAT, "num_kv_blocks": num_kv_blocks, **(metadata or {})}
        self.clock = DeviceClock(device)
        self.origin = time.perf_counter()
        self.previous_resolved_at = self.origin
        self.steps: list[TracedStep] = []
        self.events: list[dict] = []  # request tracks and KV snapshots
        self.num_saved = -1  # len(steps) + len(events) at the last save
        self.num_requests = 0
        self.tracks: dict[str, RequestTrack] = {}  # requests not drawn to the end yet
        self.admitted: set[Sequence] = set()  # running sequences, as of the latest step described
        self.decoding: set[Sequence] = set()  # admitted sequences whose prompt is done
        self.finishing: list[tuple[Sequence, float]] = []  # ended; drawn after the step that ended them
        if path is not None:
            atexit.register(self.save_if_changed)

    def seconds(self, perf_counter_time: float) -> float:
        return perf_counter_time - self.origin

    # Request hooks (called by the engine).

    def request_arrived(self, seq: Sequence) -> None:
        if seq.request_id in self.tracks:  # an id used again: draw its previous request first
            self.draw_finished()
        self.num_requests += 1
        tid, now = self.num_requests, self.seconds(time.perf_counter())
        self.tracks[seq.request_id] = RequestTrack(tid, seq.request_id, now, "queued", now, now)
        self.events += thread_name(REQUESTS_PID, tid, f"request {seq.request_id}")

    def request_finished(self, seq: Sequence) -> None:
        """seq stopped, ran out of length or was aborted."""
        self.admitted.discard(seq)
        self.decoding.discard(seq)
        if seq.request_id in self.tracks:
            self.finishing.append((seq, time.perf_counter()))

    # Steps.

    def describe_step(self, launched: LaunchedStepView, scheduler: Scheduler) -> StepDetail:
        """Per-request detail of a step just scheduled: a set lookup per sequence, O(running) when it preempted."""
        preempted = []
        if launched.record.num_preemptions:
            preempted = [seq for seq in self.admitted if seq.status is SequenceStatus.WAITING]
            self.admitted.difference_update(preempted)
            self.decoding.difference_update(preempted)
        batch, decoding = launched.batch, self.decoding
        admitted, chunks = [], []
        # Usually every sequence decodes: one C-level pass finds that; otherwise look at the others one by one.
        fresh = [] if decoding.issuperset(batch.seqs) else zip(batch.seqs, batch.num_new_tokens)
        for seq, num_new_tokens in fresh:
            if seq in decoding:
                continue
            if seq not in self.admitted:
                self.admitted.add(seq)
                if seq.request_id in self.tracks:  # not one that was running before the trace began
                    admitted.append((seq, seq.num_computed_tokens))
            ends_prompt = seq.num_computed_tokens + num_new_tokens == seq.num_tokens
            if ends_prompt:
                decoding.add(seq)
            chunks.append((seq, num_new_tokens, ends_prompt))
        kv_blocks = None
        if self.kv_every and launched.record.step_id % self.kv_every == 0:
            kv_blocks = self.snapshot_kv_blocks(scheduler)
        return StepDetail(admitted, chunks, preempted, len(scheduler.block_manager.cached_block_ids), kv_blocks)

    def snapshot_kv_blocks(self, scheduler: Scheduler) -> KvBlocks:
        block_manager = scheduler.block_manager
        owners = [-1] * block_manager.num_blocks
        for seq in scheduler.running:  # admission order: a shared block goes to its earliest holder
            track = self.tracks.get(seq.request_id)
            for block_id in seq.block_table:
                if owners[block_id] < 0:
                    owners[block_id] = track.tid if track is not None else 0
        states = []
        for block in block_manager.blocks:
            if block.ref_count:
                states.append(SHARED if block.ref_count > 1 else USED)
            elif block.hash is not None and block_manager.cached_block_ids.get(block.hash) == block.block_id:
                states.append(CACHED)
            else:
                states.append(FREE)
        return KvBlocks("".join(states), owners)

    def on_step(self, record: StepRecord) -> None:
        """The step listener: called once the step's tokens are back. Keeps plain numbers; trace() makes events."""
        # A step lasts from the previous step's tokens (or its own scheduling, if later) to its own tokens: steps
        # never overlap on this clock, also when the engine schedules one step ahead.
        start, end = max(record.scheduled_at, self.previous_resolved_at), record.resolved_at
        self.previous_resolved_at = end
        detail = record.detail
        assert detail is not None, "a traced step without detail: describe_step was not set"
        host_times = (record.scheduled_at, record.batched_at, record.planned_at, record.launched_at,
                      record.resolve_started_at, record.resolved_at)  # fmt: skip
        device_times = None
        if record.events is not None:
            marks = (record.events.start, record.events.forward_done, record.events.end)
            device_times = tuple(self.clock.host_time(mark) for mark in marks)
        counts = (
            record.step_id, record.num_seqs, record.num_prefill_tokens, record.num_decode_tokens, record.num_sampled,
            record.num_generated, record.num_running, record.num_waiting, self.num_kv_blocks - record.num_free_blocks,
            detail.num_cached_blocks, record.num_free_blocks, record.num_preemptions,
            sum(cached for _, cached in detail.admitted), record.num_drafts, record.num_draft_tokens,
            record.num_accepted_tokens,
        )  # fmt: skip
        self.steps.append(TracedStep(start, end, host_times, device_times, counts))
        if detail.kv_blocks is not None:
            kv = {"step": record.step_id, "states": detail.kv_blocks.states, "owners": detail.kv_blocks.owners}
            self.events.append(instant("KV blocks", "kv", ENGINE_PID, STEPS_TID, self.seconds(record.batched_at), kv))
        if detail.admitted or detail.chunks or detail.preempted:
            self.follow_requests(detail, self.seconds(start), self.seconds(end))
        if self.finishing:
            self.draw_finished()

    def step_events(self, step: TracedStep) -> list[dict]:
        args = dict(zip(STEP_FIELDS, step.counts))
        start = self.seconds(step.start)
        events = [span("step", "step", ENGINE_PID, STEPS_TID, start, self.seconds(step.end), args)]
        events += [counter(name, start, {key: args[key] for key in keys}) for name, keys in COUNTERS.items()]
        phase_args = {"step": args["step"]}
        times = [self.seconds(t) for t in step.host_times]
        host_spans = [(times[0], times[1]), (times[1], times[2]), (times[2], times[3]), (times[4], times[5])]
        for name, (begin, end) in zip(HOST_PHASES, host_spans):
            events.append(span(name, "host", ENGINE_PID, HOST_TID, begin, end, phase_args))
        if step.device_times is not None:
            times = [self.seconds(t) for t in step.device_times]
            for name, begin, end in zip(DEVICE_PHASES, times, times[1:]):
                events.append(span(name, "device", ENGINE_PID, DEVICE_TID, begin, end, phase_args))
        return events

    def follow_requests(self, detail: StepDetail, start: float, end: float) -> None:
        for seq in detail.preempted:
            if (track := self.tracks.get(seq.request_id)) is not None:
                self.close_span(track, start)
                track.num_preemptions += 1
                self.events.append(instant("preempted", "request", REQUESTS_PID, track.tid, start))
                track.open_span, track.open_since = "waiting (preempted)", start
        for seq, cached_tokens in detail.admitted:
            if (track := self.tracks.get(seq.request_id)) is not None:
                self.close_span(track, start)
                track.admitted_at = start if track.admitted_at is None else track.admitted_at
                args = {"prefix_cache_hit_tokens": cached_tokens}
                self.events.append(instant("admitted", "request", REQUESTS_PID, track.tid, start, args))
        for seq, num_tokens, ends_prompt in detail.chunks:
            if (track := self.tracks.get(seq.request_id)) is not None:
                name = "recompute" if track.num_preemptions else "prefill"
                self.events.append(span(name, "request", REQUESTS_PID, track.tid, start, end, {"tokens": num_tokens}))
                track.last_end = end
                if ends_prompt:
                    track.first_token_at = end if track.first_token_at is None else track.first_token_at
                    track.open_span, track.open_since = "decode", end

    def close_span(self, track: RequestTrack, at: float) -> None:
        if track.open_span is not None:
            self.events.append(span(track.open_span, "request", REQUESTS_PID, track.tid, track.open_since, at))
            track.open_span, track.last_end = None, max(track.last_end, at)

    def draw_finished(self) -> None:
        for seq, finished_at in self.finishing:
            track = self.tracks.pop(seq.request_id)
            at = max(self.seconds(finished_at), track.last_end)
            self.close_span(track, at)
            reason = seq.finish_reason
            self.events.append(instant("finished", "request", REQUESTS_PID, track.tid, at, {"reason": reason}))
            self.events.append(span("request", "request", REQUESTS_PID, track.tid, track.arrived_at, at, {
                "request_id": seq.request_id,
                "prompt_tokens": seq.num_prompt_tokens,
                "cached_tokens": max(seq.num_cached_tokens, 0),
                "output_tokens": seq.num_output_tokens - (seq.pending_sample_index >= 0),  # less a placeholder
                "finish_reason": reason,
                "preemptions": track.num_preemptions,
                "queued_ms": milliseconds_since(track.arrived_at, track.admitted_at),
                "time_to_first_token_ms": milliseconds_since(track.arrived_at, track.first_token_at),
                "latency_ms": milliseconds_since(track.arrived_at, at),
            }))  # fmt: skip
        self.finishing.clear()

    # The trace.

    def trace(self) -> dict:
        """The trace so far, as trace-event JSON (the Object Format, with otherData)."""
        self.draw_finished()
        names = process_name(ENGINE_PID, "engine") + process_name(REQUESTS_PID, "requests")
        for tid, name in ((HOST_TID, "host"), (DEVICE_TID, "device"), (STEPS_TID, "steps")):
            names += thread_name(ENGINE_PID, tid, name)
        step_events = [event for step in self.steps for event in self.step_events(step)]
        return {"traceEvents": names + step_events + self.events, "displayTimeUnit": "ms", "otherData": self.metadata}

    def save(self, log: bool = True) -> None:
        if self.path is None:
            raise ValueError("this tracer keeps its trace in memory (path=None): call trace() instead")
        trace = self.trace()
        temporary = f"{self.path}.tmp"
        with open(temporary, "w", encoding="utf-8") as handle:
            json.dump(trace, handle, separators=(",", ":"))
        os.replace(temporary, self.path)
        self.num_saved = len(self.steps) + len(self.events)
        if log:
            logger.info("trace of %d events written to %s", len(trace["traceEvents"]), self.path)

    def save_if_changed(self) -> None:
        """At exit (atexit) and when stopped; says nothing unless the write fails."""
        if self.finishing or self.num_saved != len(self.steps) + len(self.events):
            try:
                self.save(log=False)
            except OSError as error:
                logger.warning("could not write the trace to %s: %s", self.path, error)

    def close(self) -> None:
        """Stop following the engine (LLMEngine.stop_trace); a trace with a path is written one last time."""
        if self.path is not None:
            atexit.unregister(self.save_if_changed)
            self.save_if_changed()


def milliseconds_since(start: float, end: float | None) -> float | None:
    return None if end is None else round((end - start) * 1e3, 3)
