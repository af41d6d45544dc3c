"""The scheduler: one token budget per step, shared by decodes, prefill chunks and new admissions.

Each step a running sequence gets min(uncomputed tokens, budget left): decodes first, then continuing prefill
chunks, then waiting requests in arrival order. When blocks run out, the most recently admitted running request
is preempted: its blocks are freed and it is recomputed later (its prefix may still be cached).

Speculative decoding: a decode whose sequence carries draft tokens (Sequence.draft_token_ids) verifies them: it gets
1 + drafts tokens of the budget and blocks for all of them (lookahead slots). Drafts are trimmed to the budget and
to the tokens the sequence may still generate; lookahead that finds too few free blocks is dropped, never paid for
by a preemption. The step computes every one of those positions, but only the accepted drafts count as computed
(append_verified): the rejected positions' K/V is stale, overwritten by the next step, which starts there, and
never hashed; blocks past the computed tokens go back to the pool.

State indices: a sequence takes a state index (0..max_num_seqs-1, the index of its sampling state on the device) when
it is first admitted, with one for each of its forks (n > 1), and keeps it through preemption until it ends. A request
is admitted only when indices are free for all its samples, so admitted sequences, running or preempted, never number
more than max_num_seqs.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from pagedllm.scheduler.block_manager import BlockManager
from pagedllm.scheduler.sequence import FINISHED, PLACEHOLDER, RUNNING, WAITING, Sequence


@dataclass(slots=True)
class ScheduledBatch:
    seqs: list[Sequence]
    num_new_tokens: list[int]  # per sequence: tokens computed this step
    new_state_holders: list[Sequence] = field(default_factory=list)  # took a state index in this schedule (forks too)
    released_state_indices: list[int] = field(default_factory=list)  # of sequences that ended since the last batch
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (source, destination): before the step
    # Draft tokens verified in all (each sequence's are its draft_token_ids, within its num_new_tokens); 0: none.
    num_draft_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def is_empty(self) -> bool:
        return not self.seqs


# A waiting prompt whose next blocks another sequence computes in this step waits a step for them when they hold at
# least this share of what it would compute: a one-block system prompt shared by short chats is not worth a step.
PENDING_SHARE_TO_WAIT = 0.25


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the last one is preempted first
        self.num_preemptions = 0
        self.free_state_indices = list(range(max_num_seqs - 1, -1, -1))  # popped from the end: 0 first
        self.released_state_indices: list[int] = []  # handed to the device side with the next batch

    def add(self, seq: Sequence) -> None:
        """Queue a request's first sample; its other samples ride along in seq.forks."""
        assert 1 + len(seq.forks) <= self.max_num_seqs, "a request needs a state index for each of its samples"
        for sample in (seq, *seq.forks):
            max_tokens = sample.sampling_params.max_tokens
            longest = self.max_model_len if max_tokens is None else sample.num_prompt_tokens + max_tokens
            sample.max_num_tokens = min(longest, self.max_model_len)
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        scheduled: dict[Sequence, int] = {}
        budget = self.max_num_batched_tokens
        preempted = False
        decodes, chunks = self._runnable()
        for seq in decodes + chunks:
            if budget == 0:
                break
            if seq.status is not RUNNING:  # preempted earlier in this loop
                continue
            if seq.draft_token_ids and not self._fit_lookahead(seq, budget):
                seq.draft_token_ids = []
            num_new_tokens = min(seq.num_uncomputed_tokens + len(seq.draft_token_ids), budget)
            while not self.block_manager.allocate_blocks_for(seq, num_new_tokens):
                victim = self.running[-1]
                budget += scheduled.pop(victim, 0)
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                scheduled[seq] = num_new_tokens
                budget -= num_new_tokens
        num_draft_tokens = 0
        for seq in decodes:  # drafts of a sequence left out of this step (no budget) wait for no step
            if seq.draft_token_ids and seq not in scheduled:
                seq.draft_token_ids = []
            num_draft_tokens += len(seq.draft_token_ids)
        new_state_holders: list[Sequence] = []
        if not preempted:  # admitting now would only take blocks that running requests need
            self._admit_waiting(scheduled, budget, new_state_holders)
        batch = ScheduledBatch(list(scheduled), list(scheduled.values()), new_state_holders)
        batch.num_draft_tokens = num_draft_tokens
        batch.block_copies = self.block_manager.take_pending_copies()
        if not batch.is_empty():  # an empty batch reaches no device: keep the releases for the next one
            batch.released_state_indices, self.released_state_indices = self.released_state_indices, []
        return batch

    def _fit_lookahead(self, seq: Sequence, budget: int) -> bool:
        """Trim seq's drafts to what this step can verify: 1 + drafts within the budget, and no more than the tokens
        seq may still generate (the step yields up to 1 + drafts). Then take the blocks for them, if free; False
        when none is left to verify or the blocks are not free (then it decodes one token, as without drafts)."""
        drafts = seq.draft_token_ids
        del drafts[max(0, min(budget, seq.max_num_tokens - seq.num_tokens) - 1) :]
        return bool(drafts) and self.block_manager.allocate_blocks_for(seq, 1 + len(drafts))

    def _runnable(self) -> tuple[list[Sequence], list[Sequence]]:
        """Running sequences with tokens to compute, in admission order: decodes (one token), prefill chunks (more).
        A sequence whose pending token already ends it (length) waits for that token instead of running on."""
        decodes, chunks = [], []
        for seq in self.running:
            if seq.pending_sample_index >= 0 and self._length_exhausted(seq):
                continue
            num_uncomputed = seq.num_uncomputed_tokens
            if num_uncomputed == 1:
                decodes.append(seq)
            elif num_uncomputed > 1:
                chunks.append(seq)
        return decodes, chunks

    def _admit_waiting(self, scheduled: dict[Sequence, int], budget: int, new_state_holders: list[Sequence]) -> None:
        """Admit waiting requests in arrival order while budget, blocks and state indices last. One whose prompt
        shares enough with blocks this step computes for another (_shares_pending_blocks) waits for the next step,
        where it finds them cached, instead of computing them again; the requests behind it go on."""
        pending: set[int] | None = None  # hashes of the full blocks this step computes, made when first needed
        index = 0
        while index < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[index]
            if seq.state_index < 0 and len(self.free_state_indices) < 1 + len(seq.forks):
                break  # first admission: every sample of the request needs a state index
            # Prompt logprobs need the logits of every prompt position: such a request computes its whole prompt.
            caches = self.block_manager.enable_prefix_caching and not seq.wants_prompt_logprobs
            cached_blocks = self.block_manager.find_cached_prefix(seq) if caches else []
            if caches:
                if pending is None:
                    pending = self._blocks_computed_this_step(scheduled)
                if self._shares_pending_blocks(seq, cached_blocks, pending):
                    index += 1
                    continue
            self.block_manager.take_cached_prefix(seq, cached_blocks)
            num_new_tokens = min(seq.num_uncomputed_tokens, budget)
            if not self.block_manager.allocate_blocks_for(seq, num_new_tokens):
                self.block_manager.free(seq)
                break
            if seq.num_cached_tokens < 0:
                seq.num_cached_tokens = seq.num_computed_tokens
            if seq.state_index < 0:
                for holder in (seq, *seq.forks):
                    holder.state_index = self.free_state_indices.pop()
                    new_state_holders.append(holder)
            del self.waiting[index]
            seq.status = RUNNING
            self.running.append(seq)
            scheduled[seq] = num_new_tokens
            budget -= num_new_tokens
            if pending is not None:
                pending.update(self._chunk_block_hashes(seq, num_new_tokens))

    def _blocks_computed_this_step(self, scheduled: dict[Sequence, int]) -> set[int]:
        """The hashes of the full blocks that this step's prompt chunks compute (a verify step's blocks are not
        computed until accepted, and a decode fills a block too rarely to count)."""
        pending: set[int] = set()
        for seq, num_new_tokens in scheduled.items():
            if num_new_tokens > 1 and not seq.draft_token_ids:
                pending.update(self._chunk_block_hashes(seq, num_new_tokens))
        return pending

    def _chunk_block_hashes(self, seq: Sequence, num_new_tokens: int) -> Iterator[int]:
        manager = self.block_manager
        first = seq.num_computed_tokens // manager.block_size  # blocks before it are full, computed and hashed
        previous_hash = manager.hash_before(seq.block_table, first)
        return manager.full_block_hashes(seq.token_ids, first, seq.num_computed_tokens + num_new_tokens, previous_hash)

    def _shares_pending_blocks(self, seq: Sequence, cached_blocks: list[int], pending: set[int]) -> bool:
        """Whether seq's prompt goes on, past its cached blocks, with blocks this step computes for another sequence,
        holding at least PENDING_SHARE_TO_WAIT of the tokens it would compute: then waiting one step saves them."""
        if not pending:
            return False
        manager = self.block_manager
        cacheable_end = seq.num_tokens - 1  # the last token is always computed (find_cached_prefix)
        previous_hash = manager.hash_before(cached_blocks, len(cached_blocks))
        shared = 0
        for block_hash in manager.full_block_hashes(seq.token_ids, len(cached_blocks), cacheable_end, previous_hash):
            if block_hash not in pending:
                break
            shared += 1
        to_compute = seq.num_tokens - len(cached_blocks) * manager.block_size
        return shared > 0 and shared * manager.block_size >= PENDING_SHARE_TO_WAIT * to_compute

    def _preempt(self, seq: Sequence) -> None:
        assert seq.pending_sample_index < 0, "a sequence is preempted only once its tokens are all known"
        seq.draft_token_ids = []
        self.block_manager.free(seq)
        seq.status = WAITING
        self.running.remove(seq)
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def advance(self, batch: ScheduledBatch) -> None:
        """Count the step's tokens as computed and index newly full blocks; a sequence whose prompt this step
        completed forks its other samples. Sequences that ended since the step was scheduled are skipped."""
        for seq, num_new_tokens in zip(batch.seqs, batch.num_new_tokens):
            if seq.is_finished:
                continue
            # A verify step's drafts count once accepted (append_verified), never here.
            seq.num_computed_tokens += num_new_tokens - len(seq.draft_token_ids)
            self.block_manager.cache_full_blocks(seq)
            if seq.forks and seq.num_computed_tokens == seq.num_tokens:
                self._fork(seq)

    def _fork(self, seq: Sequence) -> None:
        """The other samples take seq's blocks and run from here on; their first tokens are sampled from the same
        logits as seq's, in the step that just completed the prompt (the plan gave them rows)."""
        for fork in seq.forks:
            assert fork.token_ids == seq.token_ids, "a sample forks before any token is sampled"
            self.block_manager.fork(seq, fork)
            fork.num_cached_tokens = seq.num_cached_tokens
            fork.status = RUNNING
            self.running.append(fork)
        seq.forks = []

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

    def append_verified(self, seqs: list[Sequence], runs: list[list[int]]) -> list[Sequence]:
        """A verify step's tokens: for each sequence, its accepted drafts and the token sampled after them (one token
        where it verified nothing). They are appended one by one under the stop rules; the first that ends the
        sequence is its last. The accepted drafts' K/V is computed, so every token but the new last one counts as
        computed and full blocks are hashed; blocks past the computed tokens (rejected lookahead) are released."""
        finished = []
        for seq, run in zip(seqs, runs):
            seq.draft_token_ids = []
            for token_id in run:
                seq.token_ids.append(token_id)
                reason = self._finish_reason(seq, token_id)
                if reason is not None:
                    self._finish(seq, reason)
                    finished.append(seq)
                    break
            else:
                seq.num_computed_tokens = seq.num_tokens - 1
                self.block_manager.cache_full_blocks(seq)
                self.block_manager.trim(seq)
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
        """True when the next step needs no preemption (a preempted sequence must not hold a placeholder).
        The running sequences are scheduled first, with at most `budget` new tokens in all. A sequence's table
        covers its computed tokens, so n new tokens take at most ceil(n / block_size) <= n / block_size + 1 new
        blocks, and one copy of a shared block: ceil(budget / block_size) + 2 blocks per running sequence bound the
        step. With that many free (most steps) nothing is counted; otherwise each running sequence is counted at
        its largest possible share of the budget."""
        block_manager = self.block_manager
        free = block_manager.num_free_blocks
        if free >= block_manager.blocks_for_tokens(self.max_num_batched_tokens) + 2 * len(self.running):
            return True
        return self._blocks_needed_ahead() <= free

    def _blocks_needed_ahead(self) -> int:
        """Blocks the running sequences would take if each got its largest possible share of the budget, and a
        copy of a shared block it writes into."""
        block_manager, budget = self.block_manager, self.max_num_batched_tokens
        needed = 0
        for seq in self.running:
            total = seq.num_computed_tokens + min(len(seq.token_ids) - seq.num_computed_tokens, budget)
            needed += block_manager.blocks_for_tokens(total) - len(seq.block_table)
            needed += block_manager.shared_partial_block(seq) is not None
        return needed

    @staticmethod
    def _length_exhausted(seq: Sequence) -> bool:
        return len(seq.token_ids) >= seq.max_num_tokens

    def _finish_reason(self, seq: Sequence, token_id: int) -> str | None:
        """vLLM's order: EOS (stop_reason None), then stop_token_ids (stop_reason the id), then length; EOS and stop
        tokens count only from min_tokens output tokens on."""
        params = seq.sampling_params
        if seq.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token_id in seq.eos_token_ids:
                return "stop"
            if token_id in params.stop_token_ids:
                seq.stop_reason = token_id
                return "stop"
        if self._length_exhausted(seq):
            return "length"
        return None

    def finish(
        self, seq: Sequence, reason: str, stop_reason: int | str | None = None, num_tokens: int | None = None
    ) -> None:
        """End a sequence for a reason the engine found (a stop string): it frees its blocks and takes no more
        tokens; a placeholder it holds for the step in flight is dropped with that step's row. num_tokens: the
        tokens it keeps, where the reason was found inside a run of accepted drafts (the rest are dropped; the
        sequence may have ended later in the run already, its reason then replaced)."""
        assert not seq.forks, "a sequence receives tokens only after its samples forked"
        if seq.pending_sample_index >= 0:
            seq.token_ids.pop()
            seq.pending_sample_index = -1
        if num_tokens is not None:
            del seq.token_ids[num_tokens:]
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.stop_reason = stop_reason
        self._finish(seq, reason)

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.draft_token_ids = []
        self.block_manager.free(seq)
        seq.status = FINISHED
        seq.finish_reason = reason
        if seq.state_index >= 0:
            self.free_state_indices.append(seq.state_index)
            self.released_state_indices.append(seq.state_index)
            seq.state_index = -1

    def abort(self, request_id: str) -> list[Sequence]:
        """End every sample of the request, wherever it is (forks not yet taken out end with their first sample)."""
        aborted = []
        for queue in (self.waiting, self.running):
            for seq in [seq for seq in queue if seq.request_id == request_id]:
                queue.remove(seq)
                for fork in (seq, *seq.forks):
                    self._finish(fork, "abort")
                    aborted.append(fork)
                seq.forks = []
        return aborted
