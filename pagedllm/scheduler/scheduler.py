"""The scheduler: one token budget per step, shared by decodes, prefill chunks and new admissions.

Each step a running sequence gets min(uncomputed tokens, budget left): decodes first, then continuing prefill
chunks, then waiting requests in arrival order. When blocks run out, the most recently admitted running request
is preempted: its blocks are freed and it is recomputed later (its prefix may still be cached).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from pagedllm.scheduler.block_manager import BlockManager
from pagedllm.scheduler.sequence import PLACEHOLDER, Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledBatch:
    seqs: list[Sequence]
    num_new_tokens: list[int]  # per sequence: tokens computed this step

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def is_empty(self) -> bool:
        return not self.seqs


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the last one is preempted first
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        scheduled: dict[Sequence, int] = {}
        budget = self.max_num_batched_tokens
        preempted = False
        # A sequence whose pending token already ends it (length) waits for that token instead of running on.
        active = [seq for seq in self.running if not (seq.pending_sample_index >= 0 and self._length_exhausted(seq))]
        decodes = [seq for seq in active if seq.num_uncomputed_tokens == 1]
        chunks = [seq for seq in active if seq.num_uncomputed_tokens > 1]
        for seq in decodes + chunks:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted earlier in this loop
                continue
            num_new_tokens = min(seq.num_uncomputed_tokens, budget)
            while not self.block_manager.allocate_slots(seq, num_new_tokens):
                victim = self.running[-1]
                budget += scheduled.pop(victim, 0)
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                scheduled[seq] = num_new_tokens
                budget -= num_new_tokens
        if not preempted:  # admitting now would only take blocks that running requests need
            budget = self._admit_waiting(scheduled, budget)
        return ScheduledBatch(list(scheduled), list(scheduled.values()))

    def _admit_waiting(self, scheduled: dict[Sequence, int], budget: int) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            cached_blocks = self.block_manager.find_cached_prefix(seq)
            self.block_manager.take_cached_prefix(seq, cached_blocks)
            num_new_tokens = min(seq.num_uncomputed_tokens, budget)
            if not self.block_manager.allocate_slots(seq, num_new_tokens):
                self.block_manager.free(seq)
                break
            if seq.num_cached_tokens < 0:
                seq.num_cached_tokens = seq.num_computed_tokens
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled[seq] = num_new_tokens
            budget -= num_new_tokens
        return budget

    def _preempt(self, seq: Sequence) -> None:
        assert seq.pending_sample_index < 0, "a sequence is preempted only once its tokens are all known"
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        self.running.remove(seq)
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def advance(self, batch: ScheduledBatch) -> None:
        """Count the step's tokens as computed and index newly full blocks. Sequences that ended since the step was
        scheduled (abort, stop) are skipped."""
        for seq, num_new_tokens in zip(batch.seqs, batch.num_new_tokens):
            if seq.is_finished:
                continue
            seq.num_computed_tokens += num_new_tokens
            self.block_manager.cache_full_blocks(seq)

    def append_tokens(self, seqs: list[Sequence], token_ids: list[int]) -> list[Sequence]:
        """Append one sampled token to each sequence (or fill its placeholder) and apply the stop rules."""
        finished = []
        for seq, token_id in zip(seqs, token_ids):
            if seq.pending_sample_index >= 0:
                seq.token_ids[-1] = token_id
                seq.pending_sample_index = -1
            else:
                seq.token_ids.append(token_id)
            reason = self._finish_reason(seq, token_id)
            if reason is not None:
                self._finish(seq, reason)
                finished.append(seq)
        if finished:
            self.running = [seq for seq in self.running if not seq.is_finished]
        return finished

    def append_placeholders(self, seqs: list[Sequence]) -> None:
        """Overlapped steps: each sampling sequence gets a PLACEHOLDER token, so the next step can be scheduled
        before this one's tokens reach the host. Row i of the step's samples belongs to seqs[i], also when seqs[i]
        ended meanwhile (it then gets no placeholder, but keeps its row)."""
        for index, seq in enumerate(seqs):
            if seq.is_finished:
                continue
            seq.token_ids.append(PLACEHOLDER)
            seq.pending_sample_index = index

    def can_schedule_ahead(self) -> bool:
        """True when the next step needs no preemption: every running sequence can get the blocks for its
        largest possible share of the budget. (A preempted sequence must not hold a placeholder.)"""
        needed = 0
        for seq in self.running:
            num_new_tokens = min(seq.num_uncomputed_tokens, self.max_num_batched_tokens)
            total = seq.num_computed_tokens + num_new_tokens
            needed += self.block_manager.blocks_for_tokens(total) - len(seq.block_table)
        return needed <= self.block_manager.num_free_blocks

    def _length_exhausted(self, seq: Sequence) -> bool:
        max_tokens = seq.sampling_params.max_tokens
        return seq.num_tokens >= self.max_model_len or (max_tokens is not None and seq.num_output_tokens >= max_tokens)

    def _finish_reason(self, seq: Sequence, token_id: int) -> str | None:
        params = seq.sampling_params
        if token_id in params.stop_token_ids or (not params.ignore_eos and token_id in seq.eos_token_ids):
            return "stop"
        if self._length_exhausted(seq):
            return "length"
        return None

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def abort(self, request_id: str) -> Sequence | None:
        for queue in (self.waiting, self.running):
            for seq in queue:
                if seq.request_id == request_id:
                    queue.remove(seq)
                    self._finish(seq, "abort")
                    return seq
        return None
