"""One step's per-row sampling settings: host arrays built from SamplingParams (plain data a step plan can carry),
and the same settings as tensors on the sampling device. A feature no row uses is None and costs nothing."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from pagedllm.sampling.params import SamplingParams


@dataclass(slots=True)
class SamplingBatch:
    """Host side, one entry per sampled row. Rows are positions in the step's logits; state indices are the
    per-request    indices (0..max_num_seqs-1) of the device-side state (penalty counts, seeded generators)."""

    temperatures: np.ndarray  # [rows] float32; 0 = greedy
    top_ps: np.ndarray | None = None  # [rows] float32
    top_ks: np.ndarray | None = None  # [rows] int64; 0 = off
    min_ps: np.ndarray | None = None  # [rows] float32
    # > 0: every non-greedy row keeps at most this many tokens, so topk() of that many replaces a full sort.
    top_k_candidates: int = 0
    seeded_rows: np.ndarray | None = None  # [seeded] int64: rows drawing from their request's own generator
    seeded_state_indices: np.ndarray | None = None  # [seeded] int64
    # Sparse additions to the logits: logit_bias, and -inf for EOS / stop_token_ids of rows still below min_tokens.
    adjusted_rows: np.ndarray | None = None  # [n] int64
    adjusted_token_ids: np.ndarray | None = None  # [n] int64
    adjustments: np.ndarray | None = None  # [n] float32
    penalty_rows: np.ndarray | None = None  # [p] int64: rows with any penalty
    penalty_state_indices: np.ndarray | None = None  # [p] int64
    presence_penalties: np.ndarray | None = None  # [p] float32; None when all are 0
    frequency_penalties: np.ndarray | None = None  # [p] float32; None when all are 0
    repetition_penalties: np.ndarray | None = None  # [p] float32; None when all are 1
    # Tokens a penalised row's request has ahead of its counts on the device (a verify row's drafts before it,
    # counted as if sampled): (index among the penalty rows, token id) pairs.
    penalty_ahead_rows: np.ndarray | None = None  # [a] int64
    penalty_ahead_token_ids: np.ndarray | None = None  # [a] int64
    # A verify step's: the sampler keeps each seeded row's generator state after its draw, so the next step can
    # rewind a generator past the draws of rejected rows (StepSampling.generator_rewinds).
    keep_generator_states: bool = False
    # A verify step's rows whose drafts were drawn from a distribution (SampledDrafts); None: every draft is one-hot.
    sampled_drafts: SampledDrafts | None = None
    # A draft model's: the sampler also returns the distribution each row was sampled from (SamplerOutput.probs).
    return_probs: bool = False
    logprob_rows: np.ndarray | None = None  # [r] int64: rows that asked for logprobs
    num_logprobs: np.ndarray | None = None  # [r] int64: how many top logprobs each of them asked for
    # The batch on the sampling device, made by the first step that samples it. A batch is reused while the same
    # sequences sample (plan_builder.LastSamplingBatch), and its rows' state indices, generators and settings stay the
    # same
    # meanwhile, so later steps take these tensors as they are: the sampler never writes into them.
    on_device: SamplingTensors | None = field(default=None, repr=False, compare=False)

    @property
    def num_rows(self) -> int:
        return len(self.temperatures)

    @property
    def all_greedy(self) -> bool:
        return not self.temperatures.any()

    @property
    def any_greedy(self) -> bool:
        return not self.temperatures.all()

    def to_device(
        self,
        device: torch.device,
        generator_for: Callable[[int], torch.Generator],
        default_generator: torch.Generator | None,
        pin_memory: bool = False,
    ) -> SamplingTensors:
        """Upload every array (through pinned memory, asynchronously, with pin_memory: a CUDA device) and look up
        the seeded rows' generators."""
        generators = {}
        if self.seeded_rows is not None:
            for row, state_index in zip(self.seeded_rows.tolist(), self.seeded_state_indices.tolist()):
                generators[row] = generator_for(state_index)
        upload = lambda array: None if array is None else array_to_device(array, device, pin_memory)
        temperatures = upload(self.temperatures)
        divisors = temperatures  # what the racing rows divide their logits by; greedy rows take 1
        if self.any_greedy and not self.all_greedy:
            divisors = upload(np.where(self.temperatures > 0, self.temperatures, np.float32(1)))
        adjustments = None
        if self.adjusted_rows is not None:
            adjustments = LogitAdjustments(
                upload(self.adjusted_rows), upload(self.adjusted_token_ids), upload(self.adjustments)
            )
        sampled_drafts = None
        if self.sampled_drafts is not None:
            sampled_drafts = self.sampled_drafts.to_device(device, generator_for, default_generator, pin_memory)
        penalties = None
        if self.penalty_rows is not None:
            penalties = PenaltyTensors(
                rows=None if len(self.penalty_rows) == self.num_rows else upload(self.penalty_rows),
                state_indices=upload(self.penalty_state_indices),
                presence=upload(self.presence_penalties),
                frequency=upload(self.frequency_penalties),
                repetition=upload(self.repetition_penalties),
                ahead_rows=upload(self.penalty_ahead_rows),
                ahead_token_ids=upload(self.penalty_ahead_token_ids),
            )
        return SamplingTensors(
            temperatures=temperatures,
            divisors=divisors,
            top_ps=upload(self.top_ps),
            top_ks=upload(self.top_ks),
            generators=generators,
            default_generator=default_generator,
            all_greedy=self.all_greedy,
            any_greedy=self.any_greedy,
            min_ps=upload(self.min_ps),
            top_k_candidates=self.top_k_candidates,
            adjustments=adjustments,
            penalties=penalties,
            logprob_rows=upload(self.logprob_rows),
            max_num_logprobs=0 if self.num_logprobs is None else int(self.num_logprobs.max()),
            keep_generator_states=self.keep_generator_states,
            sampled_drafts=sampled_drafts,
            return_probs=self.return_probs,
        )


def array_to_device(array: np.ndarray, device: torch.device, pin_memory: bool) -> torch.Tensor:
    """`array` on `device`: through pinned memory, asynchronously, with pin_memory (a CUDA device); else a plain
    copy, which the host does not need (the tensor shares the array's memory)."""
    tensor = torch.from_numpy(array)
    if pin_memory:
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


@dataclass(slots=True)
class SampledDrafts:
    """The rows of a verify step that take the rejection rule (sampling/rejection.py): every row of each sequence
    whose drafts a draft model drew from its distribution q, that is the row of each draft and the row after the
    last one. The batch that holds them treats them as greedy: its settings only shape their logits (logit_bias,
    min_tokens, penalties) and give their logprobs; their tokens come from the rule, with `distribution`'s settings."""

    rows: np.ndarray  # [d] int64, ascending: rows of the batch (a sequence's rows one after the other)
    token_ids: np.ndarray  # [d] int64: the draft each row verifies; rejection.NO_DRAFT for the row after the last
    probs: np.ndarray  # [d, vocab] float32: the q each draft was drawn from; 0 for the row after the last
    # Row i of it is rows[i]'s request's temperature, top-k, top-p, min-p and seed (the target distribution p).
    distribution: SamplingBatch

    def to_device(
        self,
        device: torch.device,
        generator_for: Callable[[int], torch.Generator],
        default_generator: torch.Generator | None,
        pin_memory: bool = False,
    ) -> SampledDraftTensors:
        distribution = self.distribution.to_device(device, generator_for, default_generator, pin_memory)
        upload = lambda array: array_to_device(array, device, pin_memory)
        return SampledDraftTensors(
            upload(self.rows), self.rows.tolist(), upload(self.token_ids), upload(self.probs), distribution
        )


@dataclass(slots=True)
class SampledDraftTensors:
    rows: torch.Tensor  # [d] int64
    row_list: list[int]  # the same rows, on the host (a seeded row's generator state is kept by its batch row)
    token_ids: torch.Tensor  # [d] int64
    probs: torch.Tensor  # [d, vocab] float32
    distribution: SamplingTensors


@dataclass(slots=True)
class LogitAdjustments:
    rows: torch.Tensor  # [n] int64
    token_ids: torch.Tensor  # [n] int64
    values: torch.Tensor  # [n] float32: added to logits[rows, token_ids]


@dataclass(slots=True)
class PenaltyTensors:
    rows: torch.Tensor | None  # [p] int64; None: every row
    state_indices: torch.Tensor  # [p] int64: each row's state index in the PenaltyState
    presence: torch.Tensor | None  # [p] float32; None: all 0
    frequency: torch.Tensor | None  # [p] float32; None: all 0
    repetition: torch.Tensor | None  # [p] float32; None: all 1
    ahead_rows: torch.Tensor | None = None  # [a] int64: see SamplingBatch.penalty_ahead_rows
    ahead_token_ids: torch.Tensor | None = None  # [a] int64


@dataclass(slots=True)
class SamplingTensors:
    """Device side, one entry per sampled row. A None field: no row of the batch uses that feature."""

    temperatures: torch.Tensor  # [rows] float32; 0 = greedy
    divisors: torch.Tensor  # [rows] float32: the temperatures, 1 for greedy rows (what a race divides by)
    top_ps: torch.Tensor | None  # [rows] float32
    top_ks: torch.Tensor | None  # [rows] int64; 0 = off
    generators: dict[int, torch.Generator]  # row -> its own generator, for the rows of seeded requests only
    default_generator: torch.Generator | None  # for rows without a seed of their own (the engine's seed)
    all_greedy: bool
    any_greedy: bool
    min_ps: torch.Tensor | None = None  # [rows] float32
    top_k_candidates: int = 0  # see SamplingBatch
    adjustments: LogitAdjustments | None = None
    penalties: PenaltyTensors | None = None
    logprob_rows: torch.Tensor | None = None  # [r] int64
    max_num_logprobs: int = 0  # the largest top-N among logprob_rows
    keep_generator_states: bool = False  # see SamplingBatch
    sampled_drafts: SampledDraftTensors | None = None
    return_probs: bool = False  # see SamplingBatch


def build_sampling_batch(
    params: Sequence[SamplingParams],
    state_indices: Sequence[int] | None = None,
    num_output_tokens: Sequence[int] | None = None,
    eos_token_ids: frozenset[int] = frozenset(),
    ahead_token_ids: Sequence[Sequence[int]] | None = None,
) -> SamplingBatch:
    """params[i] is row i's request. state_indices: each row's request state index (needed when a row has penalties or a
    seed).
    num_output_tokens: tokens each row's request has generated before this sample (needed for min_tokens).
    ahead_token_ids: a verify step's, per row, the drafts before it, which its penalties count as output tokens."""
    temperatures = np.array([p.temperature for p in params], dtype=np.float32)
    batch = SamplingBatch(temperatures)
    if not params:
        return batch
    random_rows = temperatures > 0
    # A feature is detected on the list of its field (min / max of a list: half the cost of any() over a generator).
    top_ps = [p.top_p for p in params]
    if min(top_ps) < 1:
        batch.top_ps = np.array(top_ps, dtype=np.float32)
    top_ks = [p.top_k for p in params]
    if max(top_ks) > 0:
        batch.top_ks = np.array(top_ks, dtype=np.int64)
        if batch.top_ks[random_rows].all():
            batch.top_k_candidates = int(batch.top_ks.max())
    min_ps = [p.min_p for p in params]
    if max(min_ps) > 0:
        batch.min_ps = np.array(min_ps, dtype=np.float32)
    seeded = [row for row, p in enumerate(params) if p.seed is not None and not p.greedy]
    if seeded:
        assert state_indices is not None, "seeded rows need their request state indices"
        batch.seeded_rows = np.array(seeded, dtype=np.int64)
        batch.seeded_state_indices = np.array([state_indices[row] for row in seeded], dtype=np.int64)
    add_adjustments(batch, params, num_output_tokens, eos_token_ids)
    add_penalties(batch, params, state_indices, ahead_token_ids)
    batch.keep_generator_states = ahead_token_ids is not None and bool(seeded)
    asked = [row for row, p in enumerate(params) if p.logprobs is not None]
    if asked:
        batch.logprob_rows = np.array(asked, dtype=np.int64)
        batch.num_logprobs = np.array([params[row].logprobs for row in asked], dtype=np.int64)
    return batch


def add_adjustments(
    batch: SamplingBatch,
    params: Sequence[SamplingParams],
    num_output_tokens: Sequence[int] | None,
    eos_token_ids: frozenset[int],
) -> None:
    rows, token_ids, values = [], [], []
    for row, p in enumerate(params):
        if p.logit_bias:
            rows += [row] * len(p.logit_bias)
            token_ids += p.logit_bias.keys()
            values += p.logit_bias.values()
        if p.min_tokens:
            assert num_output_tokens is not None, "min_tokens needs each row's number of output tokens"
            if num_output_tokens[row] < p.min_tokens:  # EOS and stop tokens cannot be sampled yet
                banned = set(p.stop_token_ids) | (set() if p.ignore_eos else eos_token_ids)
                rows += [row] * len(banned)
                token_ids += banned
                values += [-np.inf] * len(banned)
    if rows:
        batch.adjusted_rows = np.array(rows, dtype=np.int64)
        batch.adjusted_token_ids = np.array(token_ids, dtype=np.int64)
        batch.adjustments = np.array(values, dtype=np.float32)


def add_penalties(
    batch: SamplingBatch,
    params: Sequence[SamplingParams],
    state_indices: Sequence[int] | None,
    ahead_token_ids: Sequence[Sequence[int]] | None = None,
) -> None:
    rows = [row for row, p in enumerate(params) if p.uses_penalties]
    if not rows:
        return
    if ahead_token_ids is not None:
        ahead = [(index, token) for index, row in enumerate(rows) for token in ahead_token_ids[row]]
        if ahead:
            batch.penalty_ahead_rows = np.array([index for index, _ in ahead], dtype=np.int64)
            batch.penalty_ahead_token_ids = np.array([token for _, token in ahead], dtype=np.int64)
    assert state_indices is not None, "rows with penalties need their request state indices"
    batch.penalty_rows = np.array(rows, dtype=np.int64)
    batch.penalty_state_indices = np.array([state_indices[row] for row in rows], dtype=np.int64)
    presence = np.array([params[row].presence_penalty for row in rows], dtype=np.float32)
    frequency = np.array([params[row].frequency_penalty for row in rows], dtype=np.float32)
    repetition = np.array([params[row].repetition_penalty for row in rows], dtype=np.float32)
    batch.presence_penalties = presence if presence.any() else None
    batch.frequency_penalties = frequency if frequency.any() else None
    batch.repetition_penalties = repetition if (repetition != 1).any() else None
