"""Speculative decoding: proposers guess the tokens that follow a sequence, one step verifies them all, and only what
the target model would have sampled is kept (shaped like vLLM v1's v1/spec_decode/).

`ngram` (look the sequence's last tokens up earlier in it) and `draft_model` (a small model of the same tokenizer)
propose; `speculator` drives them around each step (propose before scheduling, fill a draft model's drafts after it,
accept after the step) with `backoff` (who speculates: acceptance over a window, batch size) and `acceptance` (which
drafts are kept, exactly); `metrics` sums what the steps' records say. The scheduler sees only
Sequence.draft_token_ids; the executor sees only more sample rows.
"""
