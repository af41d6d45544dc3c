"""Sampling: how each request picks its tokens, from its SamplingParams to the token ids and logprobs of a step.

`params` (SamplingParams, per request) -> `batch` (SamplingBatch: a step's rows as host arrays, carried by the
StepPlan; SamplingTensors: the same on the device) -> `sampler` (Sampler, on the sampling rank), which keeps each
request's device state by its state index (`state`: penalty counts, seeded generators) -> `logprobs` (on the device,
then as vLLM's per-position dicts on the host). The Sampler's steps on a step's logits, in the order they run:

1. Raw logprobs: the log-softmax of the rows that asked for logprobs, before anything changes the logits.
2. The grammar's bitmask (structured outputs): tokens a row's grammar does not allow get -inf.
3. logit_bias, and -inf for EOS and stop tokens of rows still below min_tokens.
4. Penalties: repetition, frequency and presence, from the request's prompt mask and output counts.
5. Greedy rows take the argmax here; the others divide by their temperature.
6. Truncation: top-k and min-p, then top-p on the distribution they left.
7. The exponential race: argmax(logits / T - log E), E ~ Exp(1) per token, drawn from the row's own generator when
   seeded (one Triton kernel on CUDA when no row truncates or is seeded). The rows of a verify step whose drafts
   were drawn from a distribution (SamplingBatch.sampled_drafts, greedy rows until here) take the rejection rule
   instead (`rejection`), on the distribution steps 5-6 make of their logits (sampling_probs).
8. The penalised rows' output counts take the sampled tokens, on the device.
9. Logprobs of the chosen tokens: their logprob and rank, and each row's top-N, from step 1's logprobs.

This __init__ imports nothing, so the scheduler (pure Python, no torch) can import `params` alone.
"""
