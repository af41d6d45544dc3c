"""The engine's step protocol, written once: schedule -> StepPlan -> Worker.execute -> tokens back to the scheduler.

Synchronous: each step's tokens are read back before the next step is scheduled.
Overlapped (async scheduling): step N+1 is scheduled and queued on the device before step N's tokens are read
back. Each sampling sequence of step N holds a PLACEHOLDER token meanwhile; step N+1 takes the real token on the
device from step N's samples. Invariant: row r of a step's samples belongs to owners[r], the sequences that
sampled when the plan was built, whatever finishes or aborts before the rows are read. Settled first, before the next
step is scheduled: every token when the next schedule could preempt (a preempted sequence must not hold a
placeholder). Structured outputs overlap too: a constrained row's mask needs its previous token, so the executor
asks for step N+1's masks once N+1's forward is queued, and the pipeline then reads step N back (its matchers take
their tokens as they are read back) and fills them while the device runs the forward; the sampler waits for them.
Logprobs and prompt logprobs come back with the step's tokens, as vLLM's per-position dicts.

Speculative decoding (a Speculator, spec_decode/): drafts are proposed before a step is scheduled, only when no
step is in flight (a sequence holding a placeholder cannot propose); the step verifies them and is read back at
once, before the next is scheduled. Overlapped, the step in flight is settled first whenever some sequence may
verify soon, so speculating requests run synchronously; when back-off holds every one, steps overlap again.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from pagedllm.engine.grammars import advance_grammar, fill_masks
from pagedllm.engine.plan_builder import LastSamplingBatch, PlannedStep, PromptLogprobSpan, build_step_plan
from pagedllm.executor.executor import Executor
from pagedllm.executor.step_output import StepOutput
from pagedllm.executor.step_plan import StepSampling
from pagedllm.outputs import PositionLogprobs
from pagedllm.sampling.logprobs import LogprobsTensors, position_logprobs, sampled_position_logprobs
from pagedllm.scheduler.scheduler import ScheduledBatch, Scheduler
from pagedllm.scheduler.sequence import Sequence
from pagedllm.spec_decode.speculator import NOT_PROPOSED, VERIFIED, Speculator
from pagedllm.trace.step_record import StepDetail, StepRecord


@dataclass(slots=True)
class LaunchedStep:
    batch: ScheduledBatch
    owners: list[Sequence]  # owners[r] sampled row r of output
    prompt_logprob_spans: list[PromptLogprobSpan]
    sampling: StepSampling  # the plan's: which rows asked for logprobs, which prompt tokens the prompt rows predict
    output: StepOutput
    record: StepRecord
    verify_offsets: list[int] | None = None  # a verify step's (PlannedStep.verify_offsets)

    def nobody_waits(self) -> bool:
        """Every sequence this step's results are for has ended (aborted): they can be dropped unread."""
        return all(seq.is_finished for seq in self.owners) and all(s.seq.is_finished for s in self.prompt_logprob_spans)


@dataclass(slots=True)
class NewToken:
    seq: Sequence  # already appended to it and checked against the stop rules
    token_id: int
    logprobs: PositionLogprobs | None  # when the sequence asked for logprobs
    # Its index in seq.token_ids, where a verify step appended several; -1: the sequence's last token.
    position: int = -1
    # It ended the sequence by the scheduler's rules (EOS or a stop token, finish_reason "stop"): its text is left out.
    ended_by_token: bool = False


@dataclass(slots=True)
class TakeBack:
    """What a verify step's rejected rows left in a sequence's sampling state, taken back by the next plan if the
    sequence still runs then (StepSampling.generator_rewinds, uncounted_tokens)."""

    seq: Sequence
    state_index: int
    rewind_row: int  # the row of the last token it kept, whose draw its generator goes back to; -1: none
    uncounted: list[int]  # the rejected rows' tokens its penalty counts took


@dataclass(slots=True)
class PromptLogprobs:
    seq: Sequence
    first_position: int  # positions[i] is for the prompt token at first_position + 1 + i
    positions: list[PositionLogprobs]


@dataclass(slots=True)
class StepResult:
    """What one step() read back: the record of that step (None if none was read back) and its results for the
    sequences still live."""

    record: StepRecord | None = None
    tokens: list[NewToken] = field(default_factory=list)
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)


class StepPipeline:
    """Drives a scheduler and an executor (executor/executor.py; the pipeline calls only its execute).
    decode: a token id's text for Logprob.decoded_token (None leaves it None)."""

    def __init__(
        self,
        scheduler: Scheduler,
        worker: Executor,
        overlap: bool,
        decode: Callable[[int], str] | None = None,
        speculator: Speculator | None = None,
    ):
        self.scheduler, self.worker, self.overlap, self.decode = scheduler, worker, overlap, decode
        self.speculator = speculator
        self.take_backs: list[TakeBack] = []  # for the next plan
        self.in_flight: LaunchedStep | None = None
        self.settled: StepResult | None = None  # the step in flight, read back early for the next step's masks
        self.step_ids = itertools.count()
        self.last_sampling = LastSamplingBatch()
        # Set by a tracer: called with each launched step and the scheduler, its result goes in record.detail.
        self.describe_step: Callable[[LaunchedStep, Scheduler], StepDetail] | None = None

    def has_work(self) -> bool:
        if self.in_flight is not None and self.in_flight.nobody_waits():
            self.in_flight = None
        return self.scheduler.has_unfinished() or self.in_flight is not None

    def step(self) -> StepResult:
        """Run one step; returns what came back: each live sequence's new token, already appended and checked
        against the stop rules, and the prompt logprobs computed."""
        if not self.overlap:
            launched = self.launch(previous=None)
            if launched is None:
                return StepResult()
            self.scheduler.advance(launched.batch)
            return self.resolve(launched)
        if self.in_flight is not None and self.settles_first():
            return self.resolve_in_flight()
        launched = self.launch(self.in_flight)  # a step with constrained rows reads the one in flight back inside
        resolved, self.settled = self.settled or self.resolve_in_flight(), None
        if launched is None:
            return resolved
        # After resolving: the batch's full blocks are hashed with real tokens, never placeholders.
        self.scheduler.advance(launched.batch)
        if launched.verify_offsets is not None:  # proposed with nothing in flight: read back at once
            return self.resolve(launched)
        self.scheduler.append_placeholders(launched.owners)
        self.in_flight = launched
        return resolved

    def settles_first(self) -> bool:
        """The step in flight must be read back before the next is scheduled: the next schedule could preempt, or
        some sequence may verify drafts (which needs its last token on the host)."""
        speculating = self.speculator is not None and self.speculator.may_verify_soon(self.scheduler)
        return speculating or not self.scheduler.can_schedule_ahead()

    def launch(self, previous: LaunchedStep | None) -> LaunchedStep | None:
        scheduled_at = time.perf_counter()
        preemptions_before = self.scheduler.num_preemptions
        proposal = None
        if self.speculator is not None and previous is None:
            proposal = self.speculator.propose(self.scheduler)
        batch = self.scheduler.schedule()
        if batch.is_empty():
            return None
        if batch.num_draft_tokens:
            self.speculator.fill(batch)
        batched_at = time.perf_counter()
        step_id = next(self.step_ids)
        planned = build_step_plan(batch, step_id, self.scheduler.block_manager.block_size, self.last_sampling)
        planned_at = time.perf_counter()
        sampling = planned.plan.sampling  # the one part of the plan the launched step keeps
        self.add_take_backs(sampling)
        previous_output = previous.output if previous is not None else None
        masks = None
        if len(planned.plan.bitmask_rows):
            masks = lambda: self.fill_masks(planned, previous)  # noqa: E731
        output = self.worker.execute(planned.plan, previous_output, masks)
        if self.speculator is not None:
            self.speculator.mirror(planned.plan, previous_output)
        num_decode = sum(1 for seq, n in zip(batch.seqs, batch.num_new_tokens) if n == 1 and seq.num_output_tokens)
        if batch.num_draft_tokens:  # a verifying sequence's last token and drafts are decode tokens too
            pairs = zip(batch.seqs, batch.num_new_tokens)
            num_decode = sum(n for seq, n in pairs if n == 1 + len(seq.draft_token_ids) and seq.num_output_tokens)
        record = StepRecord(
            step_id=step_id,
            num_seqs=len(batch.seqs),
            num_prefill_tokens=batch.num_tokens - num_decode,
            num_decode_tokens=num_decode,
            num_sampled=len(planned.owners),
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
        if self.speculator is not None:
            record.speculation = NOT_PROPOSED if proposal is None else proposal.choice
            if batch.num_draft_tokens:
                record.speculation = VERIFIED
            record.num_paused = 0 if proposal is None else proposal.num_paused
        launched = LaunchedStep(
            batch, planned.owners, planned.prompt_logprob_spans, sampling, output, record, planned.verify_offsets
        )
        if self.describe_step is not None:
            record.detail = self.describe_step(launched, self.scheduler)
        return launched

    def fill_masks(self, planned: PlannedStep, previous: LaunchedStep | None) -> np.ndarray:
        """The constrained rows' masks, asked for by the executor once the step's forward is queued: the step in
        flight (previous) is read back first, its tokens taken by their matchers, then each row is filled."""
        if previous is not None and self.in_flight is previous:
            self.settled = self.resolve_in_flight()
        return fill_masks(planned.owners, planned.plan.bitmask_rows, planned.verify_offsets)

    def add_take_backs(self, sampling: StepSampling) -> None:
        """The last verify step's take-backs, for the sequences still running (an ended one's state index is
        released, and may be taken again in this very plan)."""
        for take_back in self.take_backs:
            if take_back.seq.is_finished:
                continue
            if take_back.rewind_row >= 0:
                sampling.generator_rewinds.append((take_back.state_index, take_back.rewind_row))
            sampling.uncounted_tokens += [(take_back.state_index, token) for token in take_back.uncounted]
        self.take_backs = []

    def resolve_in_flight(self) -> StepResult:
        if self.in_flight is None:
            return StepResult()
        launched, self.in_flight = self.in_flight, None
        return self.resolve(launched)

    def resolve(self, launched: LaunchedStep) -> StepResult:
        """Read the step's results (waiting for the device) and hand them to their sequences, unless these ended
        meanwhile: first the prompt logprobs, then each token to its owner."""
        launched.record.resolve_started_at = time.perf_counter()
        result = StepResult(launched.record, prompt_logprobs=self.prompt_logprobs(launched))
        owners, token_ids = launched.owners, launched.output.token_ids()
        logprobs = {}
        if launched.sampling.batch.logprob_rows is not None:
            tensors = launched.output.logprobs()
            logprobs = sampled_position_logprobs(launched.sampling.batch, tensors, token_ids, self.decode)
        if launched.verify_offsets is not None:
            result.tokens = self.take_verified(launched, token_ids, logprobs)
        else:
            live = [row for row, seq in enumerate(owners) if not seq.is_finished]
            seqs, live_token_ids = owners, token_ids  # the common case: every owner still runs
            if len(live) < len(owners):
                seqs, live_token_ids = [owners[row] for row in live], [token_ids[row] for row in live]
            self.scheduler.append_tokens(seqs, live_token_ids)
            result.tokens = [
                NewToken(seq, token_id, logprobs.get(row)) for row, seq, token_id in zip(live, seqs, live_token_ids)
            ]
        self.follow_tokens(result.tokens)
        launched.record.num_generated = len(result.tokens)
        launched.record.resolved_at = time.perf_counter()
        return result

    def follow_tokens(self, tokens: list[NewToken]) -> None:
        """Mark the tokens that ended their sequence by the scheduler's rules, and give every other token of a
        constrained sequence to its matcher, in order (a verify step's run may end early: at its grammar's end, the
        tokens after it are dropped and skipped here)."""
        for token in tokens:
            seq = token.seq
            position = token.position if token.position >= 0 else seq.num_tokens - 1
            if position >= seq.num_tokens:
                continue
            if seq.is_finished and position == seq.num_tokens - 1 and seq.finish_reason == "stop":
                token.ended_by_token = True
            elif seq.grammar is not None:
                advance_grammar(self.scheduler, seq, token.token_id, position)

    def take_verified(self, launched: LaunchedStep, token_ids: list[int], logprobs: dict) -> list[NewToken]:
        """A verify step's rows, one run of rows per owner (offset 0 starts it): each live owner keeps its accepted
        drafts and the token after them (Speculator.accept), appended under the stop rules. The rows it did not
        keep leave take-backs for the next plan."""
        owners, record = launched.owners, launched.record
        starts = [row for row, offset in enumerate(launched.verify_offsets) if offset == 0]
        verified = []  # (first row, Verified, tokens before)
        for start, end in itertools.pairwise([*starts, len(owners)]):
            seq = owners[start]
            if not seq.is_finished:
                verified.append((start, self.speculator.accept(seq, token_ids[start:end]), len(seq.token_ids)))
        self.scheduler.append_verified([v.seq for _, v, _ in verified], [v.tokens for _, v, _ in verified])
        tokens = []
        for start, v, before in verified:
            record.num_drafts += v.num_drafts > 0
            record.num_draft_tokens += v.num_drafts
            record.num_accepted_tokens += len(v.tokens) - 1
            kept = len(v.seq.token_ids) - before  # fewer than v.tokens where a stop rule ended it inside the run
            tokens += [
                NewToken(v.seq, v.seq.token_ids[before + i], logprobs.get(start + i), before + i) for i in range(kept)
            ]
            if kept <= v.num_drafts and not v.seq.is_finished:
                self.take_backs.append(
                    take_back(v.seq, start, kept, token_ids[start + kept : start + v.num_drafts + 1])
                )
        return tokens

    def prompt_logprobs(self, launched: LaunchedStep) -> list[PromptLogprobs]:
        spans = launched.prompt_logprob_spans
        if not spans:
            return []
        next_token_ids = launched.sampling.prompt_logprob_token_ids.tolist()
        positions = prompt_position_logprobs(spans, launched.output.prompt_logprobs(), next_token_ids, self.decode)
        return [
            PromptLogprobs(span.seq, span.first_position, entries)
            for span, entries in zip(spans, positions)
            if not span.seq.is_finished
        ]


def prompt_position_logprobs(
    spans: list[PromptLogprobSpan],
    logprobs: LogprobsTensors,
    next_token_ids: list[int],
    decode: Callable[[int], str] | None = None,
) -> list[list[PositionLogprobs]]:
    """Each span's entries: the logprobs tensors hold the spans' rows one after the other, each row's chosen token
    being the prompt token it predicts."""
    num_logprobs = [span.seq.sampling_params.prompt_logprobs for span in spans for _ in range(span.num_rows)]
    positions = position_logprobs(logprobs, next_token_ids, num_logprobs, decode)
    bounds = list(itertools.accumulate((span.num_rows for span in spans), initial=0))
    return [positions[start:end] for start, end in itertools.pairwise(bounds)]


def take_back(seq: Sequence, start: int, kept: int, rejected: list[int]) -> TakeBack:
    """seq's verify rows start at `start`; it kept the first `kept` rows' tokens, and `rejected` are the others'."""
    params = seq.sampling_params
    rewind_row = start + kept - 1 if params.seed is not None and not params.greedy else -1
    return TakeBack(seq, seq.state_index, rewind_row, rejected if params.uses_penalties else [])
