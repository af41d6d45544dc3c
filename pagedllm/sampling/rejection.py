"""The rejection rule of speculative sampling (Leviathan et al., Chen et al.) for drafts drawn from any distribution
q, one verify row at a time, batched over rows, on the sampling device.

A row verifies draft x, drawn by the proposer from q, against the target distribution p of the same position:
x is kept with probability min(1, p(x) / q(x)); else the row's token is drawn from normalize(max(0, p - q)), the
residual. Then P(token = t) = min(p(t), q(t)) + (1 - sum_y min(p(y), q(y))) * residual(t) = p(t): the token follows
p, whatever q. The row after a sequence's last draft has no draft: it is a row with q = 0, whose residual is p.
With q one-hot at x this is: keep x with probability p(x), else draw from p without x, renormalised.

Within a sequence the rows are independent draws, so the sequence keeps its drafts up to the first row that did not
keep its own, and that row's token (acceptance.py): a rejected row's token is never its draft, since a rejection
needs p(x) < q(x), where the residual is 0.

This lives in sampling/ (not spec_decode/) because it runs inside the Sampler, where p and the request's
generators are; spec_decode/ decides which rows take it.
"""

from __future__ import annotations

import torch

NO_DRAFT = -1  # draft_token_ids of a row that verifies no draft (the row after a sequence's last draft)


def residual_distribution(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """max(0, p - q), not normalised: a rejected row draws in proportion to it."""
    return (target_probs - draft_probs).clamp_(min=0)


def rejection_rows(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    uniforms: torch.Tensor,
    noise: torch.Tensor,
) -> torch.Tensor:
    """target_probs p and draft_probs q [rows, vocab] (q of a NO_DRAFT row all 0); draft_token_ids [rows], each
    drawn from its row's q, or NO_DRAFT; uniforms [rows] U(0, 1) and noise [rows, vocab] Exp(1), independent ->
    [rows] the draft where it is kept (uniform * q(x) < p(x)), else a draw from the residual (p itself for a NO_DRAFT
    row). The draw is the exponential race, argmax(residual / noise): token t wins with probability
    residual(t) / sum(residual), so the residual needs no normalising, and tokens outside it never win."""
    has_draft = draft_token_ids >= 0
    drafts = draft_token_ids.clamp(min=0)[:, None]
    target_at_draft = target_probs.gather(1, drafts).squeeze(1)
    draft_at_draft = draft_probs.gather(1, drafts).squeeze(1)
    residual = residual_distribution(target_probs, draft_probs)
    # p <= q everywhere (p equal to q up to rounding): there is nothing to reject to, and a rejection is as unlikely.
    nothing_to_reject_to = residual.sum(dim=-1) <= 0
    kept = has_draft & ((uniforms * draft_at_draft < target_at_draft) | nothing_to_reject_to)
    recovered = (residual / noise).argmax(dim=-1)
    return torch.where(kept, draft_token_ids, recovered)
