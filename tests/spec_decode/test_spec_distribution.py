"""On fixed logits, 200,000 verify steps of one draft each keep tokens whose frequencies match the target distribution
(chi-square, a fixed seed): the first token follows the first row's distribution whether the draft was accepted or
not, the token after an accepted draft follows the second row's, and the draft is accepted as often as the rule
says, sum_x min(p(x), q(x)). Both paths of the sampler: drafts proposed with certainty (q one-hot: n-gram lookup, a
greedy request's draft), which every row samples from p and keeps the matching prefix; and drafts drawn from a draft
distribution q (a non-greedy request's draft model), which take the rejection rule, for q one-hot and for a q that
is not. Rows with top-k, top-p and temperature show that the request's settings shape the distribution the drafts
are tested against. A rule that draws a rejected row from p instead of max(0, p - q) fails the same check."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import binomtest, chisquare

from pagedllm.sampling import rejection
from pagedllm.sampling.batch import SampledDrafts, SamplingBatch, build_sampling_batch
from pagedllm.sampling.params import SamplingParams
from pagedllm.sampling.rejection import NO_DRAFT, residual_distribution
from pagedllm.sampling.sampler import sample_tokens
from pagedllm.spec_decode.acceptance import accepted_tokens

DRAWS = 200_000
VOCAB = 12
ROW_LOGITS = np.array(
    [
        [2.0, 1.5, 1.2, 0.9, 0.5, 0.4, 0.1, -0.2, -0.5, -1.0, -1.5, -3.0],  # after the last token
        [0.1, -0.4, 1.8, 0.3, 1.1, -2.0, 0.6, 0.0, -0.8, 0.9, -1.2, 0.2],  # after the draft
    ]
)
# The draft model's logits after the last token: another order, so that q puts mass where p has little or none
# (top-k and top-p keep other tokens of it) and little where p has much.
DRAFT_LOGITS = np.array([0.2, 1.9, -0.3, 1.4, 0.8, -1.0, 1.1, 0.3, -2.0, 0.6, 0.0, -0.6])
DRAFT = 1  # the one-hot draft token: likely, but not the most likely
GREEDY = SamplingParams(temperature=0)  # how the batch sees a row the rejection rule takes
SETTINGS = {
    "temperature": SamplingParams(temperature=0.9),
    "top_k": SamplingParams(temperature=1.3, top_k=5),
    "top_p": SamplingParams(temperature=1.0, top_p=0.8),
}
P_VALUE = 1e-3


def target(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The distribution a request's settings make of one row's logits: temperature, then top-k, then top-p on what
    top-k left (vLLM's rules), renormalised."""
    probs = np.exp(logits / params.temperature)
    probs /= probs.sum()
    order = np.argsort(-probs)
    keep = np.zeros(VOCAB, dtype=bool)
    keep[order[: params.top_k if params.top_k > 0 else VOCAB]] = True
    kept = np.where(keep, probs, 0) / probs[keep].sum()
    mass_before = np.cumsum(kept[order]) - kept[order]
    keep[order[mass_before >= params.top_p]] = False
    return np.where(keep, probs, 0) / probs[keep].sum()


def observed_and_expected(counts: np.ndarray, probs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The cells the distribution gives mass (a token outside it must never be drawn)."""
    assert counts[probs == 0].sum() == 0, "a token the settings exclude was drawn"
    return counts[probs > 0], probs[probs > 0] * counts.sum()


def kept_tokens(sampled: torch.Tensor, drafts: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """sampled: the two rows' tokens of each step, drafts: each step's draft -> the first kept token's counts, the
    counts of the token kept after an accepted draft, and the number accepted, by acceptance.accepted_tokens on
    each distinct (draft, first row, second row), weighted by how often it was drawn."""
    first_row, second_row = sampled.view(DRAWS, 2).numpy().T
    times = np.bincount((drafts * VOCAB + first_row) * VOCAB + second_row, minlength=VOCAB**3)
    first, after_draft, accepted = np.zeros(VOCAB, dtype=np.int64), np.zeros(VOCAB, dtype=np.int64), 0
    for triple in np.flatnonzero(times).tolist():
        draft, pair = triple // VOCAB**2, [triple // VOCAB % VOCAB, triple % VOCAB]
        tokens = accepted_tokens(pair, [draft])
        first[tokens[0]] += times[triple]
        if len(tokens) == 2:
            after_draft[tokens[1]] += times[triple]
            accepted += times[triple]
    return first, after_draft, accepted


def batch_of(params: SamplingParams, num_rows: int) -> SamplingBatch:
    """build_sampling_batch([params] * num_rows), built for one row and its row arrays repeated (a list of 400,000
    settings takes the builder ~0.4 s). params: settings of the distribution alone, which are all the rows have."""
    batch = build_sampling_batch([params])
    assert batch.seeded_rows is None and batch.penalty_rows is None and batch.adjusted_rows is None
    for name in ("temperatures", "top_ps", "top_ks", "min_ps"):
        if getattr(batch, name) is not None:
            setattr(batch, name, np.repeat(getattr(batch, name), num_rows))
    return batch


def p_values(first, after_draft, accepted, params: SamplingParams, acceptance: float) -> dict[str, float]:
    """Each check's p-value: the first token ~ p of row 0, the token after an accepted draft ~ p of row 1, the number
    accepted ~ Binomial(DRAWS, acceptance)."""
    p_first, p_after = target(ROW_LOGITS[0], params), target(ROW_LOGITS[1], params)
    return {
        "first": chisquare(*observed_and_expected(first, p_first)).pvalue,
        "after draft": chisquare(*observed_and_expected(after_draft, p_after)).pvalue,
        "accepted": binomtest(accepted, DRAWS, acceptance).pvalue,
    }


def two_row_logits() -> torch.Tensor:
    return torch.tensor(np.tile(ROW_LOGITS, (DRAWS, 1)), dtype=torch.float32)  # the two rows of each step


@pytest.mark.parametrize("name", list(SETTINGS))
def test_one_hot_drafts_keep_the_target_distribution(name):
    """The rows sample from p as without speculation; the kept prefix is the rule for q one-hot at the draft."""
    params = SETTINGS[name]
    batch = batch_of(params, 2 * DRAWS)
    generator = torch.Generator().manual_seed(0)
    sampled = sample_tokens(two_row_logits(), batch.to_device(torch.device("cpu"), None, generator)).sampled_token_ids
    counts = kept_tokens(sampled, np.full(DRAWS, DRAFT))
    p_first = target(ROW_LOGITS[0], params)
    assert min(p_values(*counts, params, acceptance=p_first[DRAFT]).values()) > P_VALUE  # min(1, p(x) / 1)


def sampled_draft_steps(params: SamplingParams, draft_q: np.ndarray, seed: int = 0) -> tuple:
    """DRAWS verify steps whose draft is drawn from draft_q, by the sampler's rejection rule as a verify step of a
    non-greedy draft-model request runs it: the batch sees the two rows as greedy, SampledDrafts has the draft and
    q on the first row, none on the second, and the request's settings."""
    generator = torch.Generator().manual_seed(seed)
    drafts = torch.multinomial(torch.tensor(draft_q, dtype=torch.float32), DRAWS, replacement=True, generator=generator)
    token_ids = np.stack([drafts.numpy(), np.full(DRAWS, NO_DRAFT)], axis=1).reshape(-1)
    probs = np.stack([np.tile(draft_q, (DRAWS, 1)), np.zeros((DRAWS, VOCAB))], axis=1).reshape(-1, VOCAB)
    rows = np.arange(2 * DRAWS)
    batch, distribution = batch_of(GREEDY, len(rows)), batch_of(params, len(rows))
    batch.sampled_drafts = SampledDrafts(rows, token_ids, probs.astype(np.float32), distribution)
    sampled = sample_tokens(two_row_logits(), batch.to_device(torch.device("cpu"), None, generator)).sampled_token_ids
    return kept_tokens(sampled, drafts.numpy())


def draft_distribution(kind: str, params: SamplingParams) -> np.ndarray:
    """one-hot at DRAFT, or the draft model's distribution under the request's settings."""
    if kind == "one-hot":
        return np.eye(VOCAB)[DRAFT]
    return target(DRAFT_LOGITS, params)


@pytest.mark.parametrize("kind", ["one-hot", "draft"])
@pytest.mark.parametrize("name", list(SETTINGS))
def test_sampled_drafts_keep_the_target_distribution(name, kind):
    params = SETTINGS[name]
    draft_q = draft_distribution(kind, params)
    acceptance = np.minimum(target(ROW_LOGITS[0], params), draft_q).sum()
    assert acceptance < 0.9 or kind == "one-hot"  # q is far enough from p for rejections to matter
    assert min(p_values(*sampled_draft_steps(params, draft_q), params, acceptance).values()) > P_VALUE


def test_a_residual_drawn_from_p_fails_the_same_check(monkeypatch):
    """The wrong rule draws rejected rows from p: the first token then follows min(p, q) + (1 - acceptance) p, and a
    rejected row may draw the draft itself, which then counts as accepted."""
    params = SETTINGS["top_k"]
    draft_q = draft_distribution("draft", params)
    acceptance = np.minimum(target(ROW_LOGITS[0], params), draft_q).sum()
    monkeypatch.setattr(rejection, "residual_distribution", lambda target_probs, draft_probs: target_probs.clone())
    checks = p_values(*sampled_draft_steps(params, draft_q), params, acceptance)
    assert checks["first"] < P_VALUE and checks["accepted"] < P_VALUE


def test_with_q_one_hot_the_rule_is_the_one_hot_rule():
    """Keep x with probability p(x) (uniform * 1 < p(x)), else draw from p without x: exactly, not in distribution."""
    p = torch.tensor(target(ROW_LOGITS[0], SETTINGS["temperature"]), dtype=torch.float32)[None]
    one_hot = torch.nn.functional.one_hot(torch.tensor([DRAFT]), VOCAB).float()
    assert torch.equal(residual_distribution(p, one_hot), p.index_fill(1, torch.tensor([DRAFT]), 0))
    below, above = p[0, DRAFT] - 1e-4, p[0, DRAFT] + 1e-4
    noise = torch.ones(2, VOCAB)
    rows = rejection.rejection_rows(p.expand(2, -1), one_hot.expand(2, -1), torch.tensor([DRAFT] * 2),
                                    torch.tensor([below, above]), noise)  # fmt: skip
    assert rows[0] == DRAFT and rows[1] == p[0].index_fill(0, torch.tensor([DRAFT]), 0).argmax()
