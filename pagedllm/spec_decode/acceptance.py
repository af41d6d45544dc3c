"""Which drafts a verify step keeps, exactly: the rejection rule of speculative sampling (Leviathan et al., Chen et
al.). Draft x, proposed from a distribution q, is kept with probability min(1, p(x) / q(x)), p being the target's
distribution at that position; at the first draft not kept the token is drawn from normalize(max(0, p - q)); after
k kept drafts one more is drawn from p. Each kept token then follows p, whatever q.

Each verify row decides on its own, from its own draw, and yields one token: its draft where the draft is kept,
else the row's own draw (the row after the last draft: a draw from p). A sequence keeps the drafts equal to the
tokens of their rows, up to the first row whose token differs, and that token (or the last row's): accepted_tokens.
A rejected row's token never equals its draft, so the prefix is exactly the drafts the rule keeps. The rows come in
two kinds, by how the drafts were proposed:

- With certainty (q one-hot at x): the n-gram lookup's drafts, and a draft model's for a greedy request (its
  argmax). The rule is then: keep x with probability p(x), else draw from p without x, renormalised; and a row that
  samples p as a step without speculation would, with the same draw, does exactly that (its token is x with
  probability p(x), and given it is not x, it follows p without x). So these rows are sampled as ever (the
  request's settings applied: logit bias, min_tokens, penalties with the drafts before the row counted,
  temperature, top-k/p, min-p, a grammar's mask), and their tokens are the very tokens a step without speculation
  would sample: greedy rows give the same tokens, and so does a seeded request (its generator is rewound past the
  draws of rejected rows, so every output position takes the same draw with or without speculation).
- Drawn from a distribution: a draft model's drafts for a non-greedy request, drawn from its own distribution under
  the request's settings (draft_model.py), which it keeps (Sequence.draft_probs). These rows take the general rule
  in the sampler (sampling/rejection.py), with p the row's distribution as the sampler computes it
  (sampler.sampling_probs, after logit bias, min_tokens and penalties), from the request's generator when seeded.
  The output follows p, but its tokens are not those of a run without speculation: they depend on the drafts, so on
  how many each step proposed (num_speculative_tokens, trimmed to the step's budget and free blocks; back-off;
  disable_by_batch_size). A seed then means: the same request with the same engine settings and the same requests
  around it gets the same tokens run after run, its drafts drawn from a generator of its own (draft_model.draft_seed)
  and its rows from its own, rewound as above.
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
