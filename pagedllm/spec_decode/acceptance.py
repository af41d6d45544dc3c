"""Which drafts a verify step keeps: exact rejection sampling for drafts proposed with certainty (q one-hot), which
both proposers do (n-gram lookup, and the draft model's argmax).

The rule (Leviathan et al., Chen et al.): draft x is accepted with probability min(1, p(x) / q(x)); at the first
rejection the token is drawn from normalize(max(0, p - q)); after k accepted drafts one more is drawn from p. With q
one-hot at x this is: accept with probability p(x); else draw from p without x, renormalised.

The verify step samples every row from its target distribution p (the request's settings applied: logit bias,
min_tokens, penalties with the drafts before the row counted, temperature, top-k/p, min-p, a grammar's mask), as a
step without speculation would. The drafts kept are the longest prefix that equals those samples, then the sample of
the first row that differs (or of the last row). That is the rule above: the row's sample t is distributed as p, so
P(t = x) = p(x), and given t != x, t is distributed as p without x, renormalised; each row's draw is independent
of the others'. So the output follows p, and it is the very token a step without speculation would sample from the
same draw: greedy rows give the same tokens, and a seeded request too (its generator is rewound past the draws of
rejected rows, so every output position takes the same draw with or without speculation).
"""

from __future__ import annotations


def accepted_tokens(sampled: list[int], drafts: list[int]) -> list[int]:
    """sampled: the k + 1 rows' tokens of one sequence (after its last token, after each of its k drafts) -> the
    tokens it keeps: the drafts that equal the samples before them, then the first sample that differs from its
    draft, or the last row's."""
    for index, draft in enumerate(drafts):
        if sampled[index] != draft:
            return sampled[: index + 1]
    return sampled[: len(drafts) + 1]
