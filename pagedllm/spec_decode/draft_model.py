"""The draft-model proposer: a small model of the target's tokenizer proposes k tokens, one decode step of its own
per token. For a greedy request it takes its argmax (q is one-hot). For any other it samples from q, its own
distribution under the request's temperature, top-k, top-p, min-p and logit_bias (the target's sampler code: the
settings that need no state of the request's; penalties, min_tokens and a grammar are the target's alone, which
costs acceptance, never exactness), and keeps q for the verify step (Sequence.draft_probs), which accepts by the
general rejection rule (sampling/rejection.py). A seeded request's drafts are drawn from a generator of its own,
seeded from the request's seed (draft_seed), so they depend on nothing else in the batch; the target's generator
stays the target's. What a seed means then: acceptance.py.

Its KV cache is its own, in this process, with as many blocks of the same size as the target's, and it is addressed
by the target's block tables: draft block b holds the draft's K/V of the positions target block b holds. So the
scheduler's block manager serves both, and prefix-cache hits, copy-on-write, preemption and rejected positions need
nothing more: after each target step, the draft runs the same plan (mirror), so wherever the target's cache holds
computed tokens, the draft's holds them too.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from pagedllm.config import ResolvedConfig
from pagedllm.executor.kv_cache import CompanionMemory, kv_block_bytes
from pagedllm.executor.start_up import start_worker
from pagedllm.executor.step_output import StepOutput
from pagedllm.executor.step_plan import SamplerRequest, StepPlan, StepSampling, block_table_array
from pagedllm.executor.worker import Worker
from pagedllm.loader.checkpoint import open_checkpoint
from pagedllm.models.spec import DecoderSpec
from pagedllm.sampling.batch import build_sampling_batch
from pagedllm.sampling.params import SamplingParams
from pagedllm.scheduler.scheduler import ScheduledBatch
from pagedllm.scheduler.sequence import Sequence

GREEDY = SamplingParams(temperature=0)
NO_ROWS = np.zeros(0, dtype=np.int64)
SEED_MULTIPLIER, SEED_INCREMENT = 6364136223846793005, 1442695040888963407  # PCG's 64-bit LCG step


class DraftModel:
    def __init__(self, resolved: ResolvedConfig, spec: DecoderSpec, tokenizer):
        """resolved, spec, tokenizer: the target's. Opens and checks the draft before anything starts: ValueError
        when it cannot propose for the target (another tokenizer or vocabulary, fewer positions); start() loads it."""
        path = resolved.speculative.model
        self.checkpoint = open_checkpoint(path, load_tokenizer=tokenizer is not None)
        draft_spec = DecoderSpec.from_hf_config(self.checkpoint.hf_config)
        check_same_tokenizer(path, draft_spec, self.checkpoint.tokenizer, spec, tokenizer)
        config = dataclasses.replace(
            resolved.config, model=path, tokenizer=None, kv_cache_memory_bytes=None, speculative_config=None,
            trace_file=None, trace_kv_every=None, quantization=None,
        )  # fmt: skip
        try:
            self.resolved = config.resolve(draft_spec, self.checkpoint.checkpoint_dtype, self.checkpoint.weights_format)
        except ValueError as error:
            raise ValueError(
                f"speculative_config: the draft model {path!r} cannot run with the target: {error}"
            ) from None
        self.block_size = config.block_size
        self.vocab_size = draft_spec.vocab_size  # the target's (check_same_tokenizer)
        self.spec = draft_spec
        self.worker: Worker | None = None

    def memory(self) -> CompanionMemory:
        """What the draft will take on the device beside the target's cache (start_worker's companion): a block of
        its own KV beside each of the target's, and its weights (at the dtype it runs in)."""
        resolved = self.resolved
        block_bytes = kv_block_bytes(self.spec, self.block_size, resolved.dtype, 1, resolved.config.kv_cache_dtype)
        return CompanionMemory(block_bytes, self.spec.num_parameters() * resolved.dtype.itemsize)

    def start(self, num_kv_blocks: int) -> None:
        """Load the draft, its KV cache as many blocks as the target's (num_kv_blocks)."""
        config = dataclasses.replace(self.resolved.config, num_kv_blocks=num_kv_blocks)
        self.worker = start_worker(dataclasses.replace(self.resolved, config=config), self.checkpoint)

    def propose(self, batch: ScheduledBatch) -> None:
        """Fill the PLACEHOLDER drafts of the batch's verifying sequences: decode step j feeds each sequence its
        (j-1)-th draft (step 0: its last token) at its position and draws the token after it (greedy requests:
        the argmax), keeping the distribution it was drawn from for the others. The slots are the step's lookahead,
        which the scheduler allocated; the target's step rewrites them with the same inputs."""
        seqs = [seq for seq in batch.seqs if seq.draft_token_ids]
        params = {seq: draft_params(seq.sampling_params) for seq in seqs}
        for seq in seqs:  # filled row by row below
            sampled = not seq.sampling_params.greedy
            seq.draft_probs = np.empty((len(seq.draft_token_ids), self.vocab_size), np.float32) if sampled else None
        copies = np.array(batch.block_copies, dtype=np.int64).reshape(-1, 2)  # a fresh private block: copy it first
        for step in range(max(len(seq.draft_token_ids) for seq in seqs)):
            seqs = [seq for seq in seqs if len(seq.draft_token_ids) > step]
            inputs = [seq.draft_token_ids[step - 1] if step else seq.token_ids[-1] for seq in seqs]
            positions = [seq.num_computed_tokens + step for seq in seqs]
            step_params = [params[seq] for seq in seqs]
            plan = decode_plan(seqs, inputs, positions, self.block_size, copies if step == 0 else NO_ROWS, step_params)
            output = self.worker.execute(plan)
            for seq, token_id in zip(seqs, output.token_ids()):
                seq.draft_token_ids[step] = token_id
            if plan.sampling.batch.return_probs:
                keep_draft_probs(seqs, step, output.probs().numpy())

    def mirror(self, plan: StepPlan, previous: StepOutput | None) -> None:
        """The target's plan, nothing sampled: the draft's cache takes the K/V of every position the target's does.
        Input tokens the step in flight sampled come from `previous` (the target's output) on the device."""
        self.worker.execute(
            dataclasses.replace(
                plan,
                sample_rows=NO_ROWS,
                sampling=draft_registrations(plan.sampling),
                prompt_logprob_rows=NO_ROWS,
                bitmask_rows=NO_ROWS,
            ),
            previous,
        )

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()


def check_same_tokenizer(path: str, draft_spec: DecoderSpec, draft_tokenizer, spec: DecoderSpec, tokenizer) -> None:
    """The draft's token ids must mean the target's: the same vocabulary size and, where both have a tokenizer, the
    same token for every id."""
    if draft_spec.vocab_size != spec.vocab_size:
        raise ValueError(
            f"speculative_config: the draft model {path!r} has a vocabulary of {draft_spec.vocab_size} tokens, the "
            f"target {spec.vocab_size}; a draft model must share the target's tokenizer"
        )
    if tokenizer is not None and draft_tokenizer is not None and draft_tokenizer.get_vocab() != tokenizer.get_vocab():
        different = sorted(set(draft_tokenizer.get_vocab().items()) ^ set(tokenizer.get_vocab().items()))[:3]
        raise ValueError(
            f"speculative_config: the draft model {path!r} has another tokenizer than the target (tokens and ids "
            f"that differ: {different}); a draft model must share the target's tokenizer"
        )


def draft_params(params: SamplingParams) -> SamplingParams:
    """How the draft samples for a request of these params: greedily for a greedy one; else under its settings that
    need no state (temperature, top-k, top-p, min-p, logit_bias), with its seed made the draft's own."""
    if params.greedy:
        return GREEDY
    seed = None if params.seed is None else draft_seed(params.seed)
    return dataclasses.replace(params.distribution_only(), logit_bias=params.logit_bias, seed=seed)


def draft_seed(seed: int) -> int:
    """The seed of a request's draft generator: one LCG step from the request's seed (mod 2**64, as
    torch.Generator.manual_seed takes it), a bijection, so distinct seeds stay distinct, and far from seed + i
    (sample i's seed): no draft stream is a target stream of the same request."""
    return (seed % 2**64 * SEED_MULTIPLIER + SEED_INCREMENT) % 2**64


def draft_registrations(sampling: StepSampling | None) -> StepSampling | None:
    """The target plan's changes to request state that the draft's sampler mirrors: the state indices released, and
    the seeded non-greedy requests registered, whose drafts draw from generators of their own (draft_params)."""
    if sampling is None:
        return None
    return StepSampling(
        build_sampling_batch([]),
        NO_ROWS,
        released_state_indices=sampling.released_state_indices,
        new_requests=[
            SamplerRequest(request.state_index, request.request_id, draft_params(request.params), [])
            for request in sampling.new_requests
            if request.params.seed is not None and not request.params.greedy
        ],
    )


def keep_draft_probs(seqs: list[Sequence], step: int, probs: np.ndarray) -> None:
    """probs[i]: the distribution seqs[i]'s draft of this step was drawn from, kept for a non-greedy one."""
    for seq, row in zip(seqs, probs):
        if seq.draft_probs is not None:
            seq.draft_probs[step] = row


def decode_plan(
    seqs: list[Sequence],
    input_ids: list[int],
    positions: list[int],
    block_size: int,
    block_copies: np.ndarray,
    params: list[SamplingParams],
) -> StepPlan:
    """One token for each sequence at its position, through its block table, sampled with params (draft_params);
    with probs when some row is not greedy."""
    position = np.array(positions, dtype=np.int64)
    tables = block_table_array([seq.block_table for seq in seqs], max(len(seq.block_table) for seq in seqs))
    rows = np.arange(len(seqs))
    query_start_loc = np.arange(len(seqs) + 1, dtype=np.int32)
    state_indices = np.array([seq.state_index for seq in seqs], dtype=np.int64)
    sampling_batch = build_sampling_batch(params, state_indices.tolist())
    sampling_batch.return_probs = not sampling_batch.all_greedy
    return StepPlan(
        step_id=-1,
        input_ids=np.array(input_ids, dtype=np.int64),
        positions=position,
        slot_mapping=tables[rows, position // block_size] * np.int64(block_size) + position % block_size,
        query_start_loc=query_start_loc,
        seq_lens=(position + 1).astype(np.int32),
        block_tables=tables,
        sample_rows=rows.astype(np.int64),
        max_query_len=1,
        max_seq_len=int(position.max()) + 1,
        decode_only=True,
        sampling=StepSampling(sampling_batch, state_indices),
        block_copies=block_copies,
    )
