"""Turn the sampler's logprob tensors (on the host) into the per-position dicts of vLLM's outputs."""

from __future__ import annotations

from collections.abc import Callable
from itertools import accumulate, pairwise
from typing import TYPE_CHECKING

from pagedllm.outputs import Logprob, PositionLogprobs

if TYPE_CHECKING:
    from pagedllm.engine.plan_builder import PromptLogprobSpan
    from pagedllm.layers.logprobs import LogprobsTensors
    from pagedllm.layers.sampling_batch import SamplingBatch


def position_logprobs(
    logprobs: LogprobsTensors,
    chosen_token_ids: list[int],
    num_logprobs: list[int],
    decode: Callable[[int], str] | None = None,
) -> list[PositionLogprobs]:
    """Row i: the chosen token first, then the row's top num_logprobs[i] tokens (rank 1, 2, ...).
    decode: a token id's text for Logprob.decoded_token (None leaves it None)."""
    top_ids, top_logprobs = logprobs.top_token_ids.tolist(), logprobs.top_logprobs.tolist()
    token_logprobs, token_ranks = logprobs.token_logprobs.tolist(), logprobs.token_ranks.tolist()
    text = decode or (lambda token_id: None)
    positions = []
    for row, token_id in enumerate(chosen_token_ids):
        entries = {token_id: Logprob(token_logprobs[row], token_ranks[row], text(token_id))}
        for rank, (top_id, top_logprob) in enumerate(zip(top_ids[row][: num_logprobs[row]], top_logprobs[row]), 1):
            entries.setdefault(top_id, Logprob(top_logprob, rank, text(top_id)))
        positions.append(entries)
    return positions


def sampled_position_logprobs(
    batch: SamplingBatch,
    logprobs: LogprobsTensors,
    sampled_token_ids: list[int],
    decode: Callable[[int], str] | None = None,
) -> dict[int, PositionLogprobs]:
    """Sample row -> its entries, for the rows of batch.logprob_rows (sampled_token_ids: every row's token)."""
    rows = batch.logprob_rows.tolist()
    chosen = [sampled_token_ids[row] for row in rows]
    return dict(zip(rows, position_logprobs(logprobs, chosen, batch.num_logprobs.tolist(), decode)))


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
    bounds = list(accumulate((span.num_rows for span in spans), initial=0))
    return [positions[start:end] for start, end in pairwise(bounds)]
