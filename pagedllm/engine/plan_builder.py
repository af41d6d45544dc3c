"""Turn the scheduler's batch into a StepPlan: numpy over whole arrays, Python loops per sequence, never per token.

This is the only place where scheduler objects become device inputs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from itertools import chain

import numpy as np

from pagedllm.engine.grammars import constrained_rows
from pagedllm.executor.step_plan import SamplerRequest, StepPlan, StepSampling, block_table_array
from pagedllm.sampling.batch import SampledDrafts, SamplingBatch, build_sampling_batch
from pagedllm.sampling.params import SamplingParams
from pagedllm.sampling.rejection import NO_DRAFT
from pagedllm.scheduler.scheduler import ScheduledBatch
from pagedllm.scheduler.sequence import Sequence


@dataclass(slots=True)
class PromptLogprobSpan:
    """Consecutive prompt logprob rows of one sequence: the logits at `first_position` and after, each predicting
    the prompt token that follows."""

    seq: Sequence
    first_position: int
    num_rows: int


@dataclass(slots=True)
class PlannedStep:
    plan: StepPlan
    owners: list[Sequence]  # owners[r] sampled row r
    prompt_logprob_spans: list[PromptLogprobSpan]  # in the order of plan.prompt_logprob_rows
    # A verify step's (speculative decoding), else None: row r is the verify_offsets[r]-th of owners[r]'s rows, which
    # are consecutive; offset j samples the token after its j-th draft (0: after its last token).
    verify_offsets: list[int] | None = None


class LastSamplingBatch:
    """The previous step's sampling batch and the sequences it sampled for. A request's SamplingParams and state index
    stay    the same while it runs, so a step that samples for the same sequences in the same order has the same batch
    (most decode steps), unless a row has min_tokens: its bans depend on its output count, so such batches are
    never kept."""

    def __init__(self):
        self.owners: list[Sequence] = []
        self.batch: SamplingBatch | None = None


def step_sampling(
    batch: ScheduledBatch,
    owners: list[Sequence],
    spans: list[PromptLogprobSpan],
    last: LastSamplingBatch,
    verify_offsets: list[int] | None = None,
) -> StepSampling:
    """verify_offsets: a verify step's (PlannedStep.verify_offsets). Its row after j drafts samples as the j-th
    token after the last one would: j more output tokens (min_tokens), the j drafts counted by its penalties. Such
    a batch is never kept: its drafts change every step. The rows of a sequence whose drafts were drawn from a
    distribution take the rejection rule (SampledDrafts): the batch sees them as greedy rows."""
    state_indices = [seq.state_index for seq in owners]
    if last.batch is not None and owners == last.owners and verify_offsets is None:  # Sequences compare by identity
        sampling_batch = last.batch
    else:
        params = [seq.sampling_params for seq in owners]
        offsets = verify_offsets or [0] * len(owners)
        drafted = []  # the rows that take the rejection rule
        if verify_offsets is not None:
            drafted = [row for row, seq in enumerate(owners) if seq.draft_probs is not None]
        for row in drafted:
            params[row] = logits_only(params[row])
        # Only rows with min_tokens read their output count and the EOS ids (every sequence of one engine has the
        # engine's EOS ids, which min_tokens bans).
        num_output_tokens, eos_token_ids = None, frozenset()
        if any([p.min_tokens for p in params]):
            num_output_tokens = [seq.num_output_tokens + offset for seq, offset in zip(owners, offsets)]
            eos_token_ids = frozenset().union(*(seq.eos_token_ids for seq in owners if seq.sampling_params.min_tokens))
        ahead = None
        if verify_offsets is not None:
            ahead = [seq.draft_token_ids[:offset] for seq, offset in zip(owners, offsets)]
        sampling_batch = build_sampling_batch(params, state_indices, num_output_tokens, eos_token_ids, ahead)
        if drafted:
            add_sampled_drafts(sampling_batch, owners, offsets, drafted)
        keep = num_output_tokens is None and verify_offsets is None
        last.owners, last.batch = owners, sampling_batch if keep else None
    targets = [span.seq.token_ids[span.first_position + 1 : span.first_position + 1 + span.num_rows] for span in spans]
    return StepSampling(
        batch=sampling_batch,
        row_state_indices=np.array(state_indices, dtype=np.int64),
        released_state_indices=batch.released_state_indices,
        new_requests=[
            SamplerRequest(seq.state_index, seq.request_id, seq.sampling_params, seq.token_ids[: seq.num_prompt_tokens])
            for seq in batch.new_state_holders
        ],
        prompt_logprob_token_ids=np.fromiter(chain.from_iterable(targets), np.int64),
        num_prompt_logprobs=max((s.seq.sampling_params.prompt_logprobs for s in spans), default=0),
    )


def logits_only(params: SamplingParams) -> SamplingParams:
    """params as a greedy row: what shapes its logits (logit_bias, min_tokens, penalties) and its logprobs, without
    the settings that choose its token (the rejection rule chooses it)."""
    return dataclasses.replace(params, temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, seed=None)


def add_sampled_drafts(batch: SamplingBatch, owners: list[Sequence], offsets: list[int], rows: list[int]) -> None:
    """The rejection rule's rows (SampledDrafts): rows[i] is the offsets[rows[i]]-th verify row of its owner, which
    verifies that draft, drawn from that row of the owner's draft_probs (none after its last draft). Row i of the
    distribution batch has the owner's own temperature, top-k, top-p, min-p and seed."""
    vocab_size = owners[rows[0]].draft_probs.shape[1]
    token_ids = np.full(len(rows), NO_DRAFT, dtype=np.int64)
    probs = np.zeros((len(rows), vocab_size), dtype=np.float32)
    for index, row in enumerate(rows):
        seq, offset = owners[row], offsets[row]
        assert len(seq.draft_probs) == len(seq.draft_token_ids), "draft distributions of other drafts"
        if offset < len(seq.draft_token_ids):
            token_ids[index] = seq.draft_token_ids[offset]
            probs[index] = seq.draft_probs[offset]
    distribution = build_sampling_batch(
        [owners[row].sampling_params.distribution_only() for row in rows], [owners[row].state_index for row in rows]
    )
    batch.sampled_drafts = SampledDrafts(np.array(rows, dtype=np.int64), token_ids, probs, distribution)
    # The rule's seeded rows draw from their generators: a rejected one is given back (StepSampling.generator_rewinds).
    batch.keep_generator_states |= distribution.seeded_rows is not None


def prompt_logprob_spans(
    seqs: list[Sequence], in_prompt: list[int], start: np.ndarray, seq_lens: np.ndarray, query_start_loc: np.ndarray
) -> tuple[list[PromptLogprobSpan], np.ndarray]:
    """For each sequence that asked for prompt logprobs: the positions computed this step that predict a prompt
    token (position p predicts token p + 1, so the last prompt position is not one), and their packed rows.
    in_prompt: the indices of the sequences that compute prompt tokens this step (no other can have such a span)."""
    spans, rows = [], []
    for index in in_prompt:
        seq = seqs[index]
        if not seq.wants_prompt_logprobs:
            continue
        first, end = int(start[index]), min(int(seq_lens[index]), seq.num_prompt_tokens - 1)
        if first < end:
            spans.append(PromptLogprobSpan(seq, first, end - first))
            rows.append(np.arange(end - first, dtype=np.int64) + query_start_loc[index])
    return spans, np.concatenate(rows) if rows else np.zeros(0, dtype=np.int64)


def verify_sample_rows(
    seqs: list[Sequence], ends: list[int], query_start_loc: np.ndarray
) -> tuple[list[Sequence], np.ndarray, list[int]]:
    """A verify step's sample rows, owners and offsets (PlannedStep.verify_offsets): a sequence that computes its
    last token and k drafts samples k + 1 rows, after each of them."""
    owners, rows, offsets = [], [], []
    for index, (seq, end) in enumerate(zip(seqs, ends)):
        num_drafts = len(seq.draft_token_ids)
        if end != len(seq.token_ids) + num_drafts:
            continue  # a prompt chunk that does not end the prompt
        last_row = int(query_start_loc[index + 1]) - 1
        owners += [seq] * (num_drafts + 1)
        rows += range(last_row - num_drafts, last_row + 1)
        offsets += range(num_drafts + 1)
    return owners, np.array(rows, dtype=np.int64), offsets


def build_step_plan(
    batch: ScheduledBatch, step_id: int, block_size: int, last_sampling: LastSamplingBatch
) -> PlannedStep:
    """Block tables are as wide as the step's longest (the worker's buffers take any width up to max_model_len's).
    last_sampling: the previous plan's sampling batch, reused where it still holds."""
    seqs = batch.seqs
    # Per-sequence loops read Python ints (a numpy scalar costs more to compare or slice with); arrays for the rest.
    starts = [seq.num_computed_tokens for seq in seqs]
    ends = [start + num_new for start, num_new in zip(starts, batch.num_new_tokens)]
    num_new = np.array(batch.num_new_tokens, dtype=np.int64)
    start = np.array(starts, dtype=np.int64)
    seq_lens = np.array(ends, dtype=np.int64)
    query_start_loc = np.zeros(len(seqs) + 1, dtype=np.int64)
    np.cumsum(num_new, out=query_start_loc[1:])
    num_tokens = int(query_start_loc[-1])

    token_seq = np.repeat(np.arange(len(seqs)), num_new)
    positions = np.arange(num_tokens) - np.repeat(query_start_loc[:-1] - start, num_new)
    if batch.num_draft_tokens:  # a verify step: each sequence's drafts follow its tokens
        chunks = (seq.token_ids[s:e] + seq.draft_token_ids for seq, s, e in zip(seqs, starts, ends))
        input_ids = np.fromiter(chain.from_iterable(chunks), np.int64, num_tokens)
    elif num_tokens == len(seqs):  # one new token each (decode): index, do not slice
        input_ids = np.array([seq.token_ids[s] for seq, s in zip(seqs, starts)], dtype=np.int64)
    else:
        input_ids = np.fromiter(
            chain.from_iterable(seq.token_ids[s:e] for seq, s, e in zip(seqs, starts, ends)), np.int64, num_tokens
        )
    tables = [seq.block_table for seq in seqs]
    block_tables = block_table_array(tables, max(map(len, tables)))
    slot_mapping = block_tables[token_seq, positions // block_size] * np.int64(block_size) + positions % block_size
    verify_offsets = None
    if batch.num_draft_tokens:
        owners, sample_rows, verify_offsets = verify_sample_rows(seqs, ends, query_start_loc)
    else:
        sampled = [i for i, (seq, end) in enumerate(zip(seqs, ends)) if end == len(seq.token_ids)]
        owners = [seqs[i] for i in sampled]
        sample_rows = query_start_loc[1:][sampled] - 1
    # Only these can complete a prompt, fork or have prompt logprobs (in a decode step, usually none).
    in_prompt = [i for i, (seq, s) in enumerate(zip(seqs, starts)) if s < seq.num_prompt_tokens]
    # A request's other samples take their first tokens from the row that completes its prompt (they fork after it).
    forking = [(i, fork) for i in in_prompt if ends[i] == len(seqs[i].token_ids) for fork in seqs[i].forks]
    if forking:
        sample_rows = np.concatenate([sample_rows, [query_start_loc[i + 1] - 1 for i, _ in forking]])
        owners += [fork for _, fork in forking]
        if verify_offsets is not None:
            verify_offsets += [0] * len(forking)
    # A pending token is its sequence's only uncomputed token, so it is that sequence's first (only) new row.
    pending = [i for i, seq in enumerate(seqs) if seq.pending_sample_index >= 0]
    spans, prompt_logprob_rows = prompt_logprob_spans(seqs, in_prompt, start, seq_lens, query_start_loc)
    plan = StepPlan(
        step_id=step_id,
        input_ids=input_ids,
        positions=positions,
        slot_mapping=slot_mapping,
        query_start_loc=query_start_loc.astype(np.int32),
        seq_lens=seq_lens.astype(np.int32),
        decoding=np.array([s >= seq.num_prompt_tokens for seq, s in zip(seqs, starts)], np.int32),
        block_tables=block_tables,
        sample_rows=sample_rows.astype(np.int64),
        max_query_len=int(num_new.max()),
        max_seq_len=int(seq_lens.max()),
        decode_only=bool((num_new == 1).all()),
        placeholder_rows=query_start_loc[pending],
        placeholder_sources=np.array([seqs[i].pending_sample_index for i in pending], dtype=np.int64),
        sampling=step_sampling(batch, owners, spans, last_sampling, verify_offsets),
        prompt_logprob_rows=prompt_logprob_rows,
        block_copies=np.array(batch.block_copies, dtype=np.int64).reshape(-1, 2),
        bitmask_rows=constrained_rows(owners),  # their masks are filled once the forward is queued
    )
    return PlannedStep(plan, owners, spans, verify_offsets)
