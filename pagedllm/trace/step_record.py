"""What a step leaves for its listeners: the pipeline's StepRecord, and the per-request StepDetail a tracer adds to
it. Plain data, so the pipeline that fills it and the tracer that reads it need not import each other."""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.executor.step_output import StepEvents
from pagedllm.scheduler.sequence import Sequence


@dataclass(slots=True)
class KvBlocks:
    """The block pool after a step was scheduled: one state character per block (events.FREE, CACHED, USED,
    SHARED) and the track id of the earliest admitted request holding it (-1: none; 0: a request that arrived
    before the trace began)."""

    states: str
    owners: list[int]


@dataclass(slots=True)
class StepDetail:
    """What a step did per request, taken when it was launched (the step's tokens are not known yet)."""

    admitted: list[tuple[Sequence, int]]  # admitted this step (first time or after preemption), prefix-cache hit tokens
    chunks: list[tuple[Sequence, int, bool]]  # prompt or recompute chunks: tokens, and whether this one ends the prompt
    preempted: list[Sequence]  # preempted when this step was scheduled
    num_cached_blocks: int  # blocks in the prefix cache's index, held or free
    kv_blocks: KvBlocks | None = None  # every kv_every steps


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
    # Speculative decoding ("" and zeros without it): what the proposal did (spec_decode/speculator.py's names),
    # the sequences back-off held, the sequences that verified drafts, their drafts, and the drafts accepted.
    speculation: str = ""
    num_paused: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    detail: StepDetail | None = None  # per-request detail, only while a tracer asks for it (describe_step)
