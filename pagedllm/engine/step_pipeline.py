"""The engine's step protocol, written once: schedule -> StepPlan -> Worker.execute -> tokens back to the scheduler.

Synchronous: each step's tokens are read back before the next step is scheduled.
Overlapped (async scheduling): step N+1 is scheduled and queued on the device before step N's tokens are read
back. Each sampling sequence of step N holds a PLACEHOLDER token meanwhile; step N+1 takes the real token on the
device from step N's samples. Invariant: row r of a step's samples belongs to owners[r], the sequences that
sampled when the plan was built, whatever finishes or aborts before the rows are read. When the next schedule could
preempt, every token is settled first (a preempted sequence must not hold a placeholder).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedllm.engine.plan_builder import build_step_plan
from pagedllm.executor.step_output import StepEvents, StepOutput
from pagedllm.scheduler.scheduler import ScheduledBatch, Scheduler
from pagedllm.scheduler.sequence import Sequence

if TYPE_CHECKING:
    from pagedllm.trace.tracer import StepDetail


@dataclass(slots=True)
class StepRecord:
    """One step as it happened: what it held, and host times (time.perf_counter()) of its phases."""

    step_id: int
    num_seqs: int
    num_prefill_tokens: int  # tokens of sequences still reading their prompt (or recomputing after preemption)
    num_decode_tokens: int
    num_sampled: int
    num_running: int  # after scheduling
    num_waiting: int
    num_free_blocks: int
    num_preemptions: int  # preemptions this step's schedule made
    scheduled_at: float  # before scheduling
    batched_at: float  # batch scheduled
    planned_at: float  # plan built
    launched_at: float  # the device work is queued
    resolve_started_at: float = 0.0  # tokens asked for (the host may wait for the device from here)
    resolved_at: float = 0.0  # tokens read back and handed to the scheduler
    num_generated: int = 0  # sampled tokens that reached a live request (rows of requests ended meanwhile drop)
    events: StepEvents | None = None  # device timings, where the worker recorded them
    detail: StepDetail | None = None  # per-request detail, only while a tracer asks for it (describe_step)


@dataclass(slots=True)
class LaunchedStep:
    batch: ScheduledBatch
    owners: list[Sequence]  # owners[r] sampled row r of output
    output: StepOutput
    record: StepRecord


class StepPipeline:
    """Drives a scheduler and a worker (anything with execute(plan, previous) -> StepOutput and table_width)."""

    def __init__(self, scheduler: Scheduler, worker, overlap: bool):
        self.scheduler, self.worker, self.overlap = scheduler, worker, overlap
        self.in_flight: LaunchedStep | None = None
        self.step_ids = itertools.count()
        self.finished_request_ids: list[str] = []  # handed to the worker with the next plan
        # Set by a tracer: called with each launched step and the scheduler, its result goes in record.detail.
        self.describe_step: Callable[[LaunchedStep, Scheduler], StepDetail] | None = None

    def forget(self, request_id: str) -> None:
        """The request ended: its per-request device state goes with the next plan."""
        self.finished_request_ids.append(request_id)

    def has_work(self) -> bool:
        if self.in_flight is not None and all(seq.is_finished for seq in self.in_flight.owners):
            self.in_flight = None  # every owner ended (aborted): nobody waits for these tokens
        return self.scheduler.has_unfinished() or self.in_flight is not None

    def step(self) -> tuple[StepRecord | None, list[tuple[Sequence, int]]]:
        """Run one step; returns the record of the step whose tokens were read back (None if none was) and each
        live sequence with its new token, already appended and checked against the stop rules."""
        if not self.overlap:
            launched = self.launch(previous=None)
            if launched is None:
                return None, []
            self.scheduler.advance(launched.batch)
            return self.resolve(launched)
        if self.in_flight is not None and not self.scheduler.can_schedule_ahead():
            return self.resolve_in_flight()
        launched = self.launch(self.in_flight)
        resolved = self.resolve_in_flight()
        if launched is not None:
            # After resolving: the batch's full blocks are hashed with real tokens, never placeholders.
            self.scheduler.advance(launched.batch)
            self.scheduler.append_placeholders(launched.owners)
            self.in_flight = launched
        return resolved

    def launch(self, previous: LaunchedStep | None) -> LaunchedStep | None:
        scheduled_at = time.perf_counter()
        preemptions_before = self.scheduler.num_preemptions
        batch = self.scheduler.schedule()
        if batch.is_empty():
            return None
        batched_at = time.perf_counter()
        finished, self.finished_request_ids = self.finished_request_ids, []
        step_id = next(self.step_ids)
        plan, owners = build_step_plan(batch, step_id, self.scheduler.block_manager.block_size,
                                       self.worker.table_width, finished)  # fmt: skip
        planned_at = time.perf_counter()
        output = self.worker.execute(plan, previous.output if previous is not None else None)
        num_decode = sum(1 for seq, n in zip(batch.seqs, batch.num_new_tokens) if n == 1 and seq.num_output_tokens)
        record = StepRecord(
            step_id=step_id,
            num_seqs=len(batch.seqs),
            num_prefill_tokens=batch.num_tokens - num_decode,
            num_decode_tokens=num_decode,
            num_sampled=len(owners),
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_free_blocks=self.scheduler.block_manager.num_free_blocks,
            num_preemptions=self.scheduler.num_preemptions - preemptions_before,
            scheduled_at=scheduled_at,
            batched_at=batched_at,
            planned_at=planned_at,
            launched_at=time.perf_counter(),
            events=output.events,
        )
        launched = LaunchedStep(batch, owners, output, record)
        if self.describe_step is not None:
            record.detail = self.describe_step(launched, self.scheduler)
        return launched

    def resolve_in_flight(self) -> tuple[StepRecord | None, list[tuple[Sequence, int]]]:
        if self.in_flight is None:
            return None, []
        launched, self.in_flight = self.in_flight, None
        return self.resolve(launched)

    def resolve(self, launched: LaunchedStep) -> tuple[StepRecord, list[tuple[Sequence, int]]]:
        """Read the step's tokens (waiting for the device) and hand each to its owner, unless it ended meanwhile."""
        launched.record.resolve_started_at = time.perf_counter()
        token_ids = launched.output.token_ids()
        live = [(seq, token) for seq, token in zip(launched.owners, token_ids, strict=True) if not seq.is_finished]
        self.scheduler.append_tokens([seq for seq, _ in live], [token for _, token in live])
        launched.record.num_generated = len(live)
        launched.record.resolved_at = time.perf_counter()
        return launched.record, live
