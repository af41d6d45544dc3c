"""The draft-model proposer: a small model of the target's tokenizer proposes k tokens, one decode step of its own
per token, greedily (its argmax: q is one-hot, as acceptance.py needs).

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
from pagedllm.executor.start_up import start_worker
from pagedllm.executor.step_output import StepOutput
from pagedllm.executor.step_plan import StepPlan, StepSampling, block_table_array
from pagedllm.executor.worker import Worker
from pagedllm.loader.checkpoint import open_checkpoint
from pagedllm.models.spec import DecoderSpec
from pagedllm.sampling.batch import build_sampling_batch
from pagedllm.sampling.params import SamplingParams
from pagedllm.scheduler.scheduler import ScheduledBatch
from pagedllm.scheduler.sequence import Sequence

GREEDY = SamplingParams(temperature=0)
NO_ROWS = np.zeros(0, dtype=np.int64)


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
        self.worker: Worker | None = None

    def start(self, num_kv_blocks: int) -> None:
        """Load the draft, its KV cache as many blocks as the target's (num_kv_blocks)."""
        config = dataclasses.replace(self.resolved.config, num_kv_blocks=num_kv_blocks)
        self.worker = start_worker(dataclasses.replace(self.resolved, config=config), self.checkpoint)

    def propose(self, batch: ScheduledBatch) -> None:
        """Fill the PLACEHOLDER drafts of the batch's verifying sequences: decode step j feeds each sequence its
        (j-1)-th draft (step 0: its last token) at its position and takes the argmax after it. The slots are the
        step's lookahead, which the scheduler allocated; the target's step rewrites them with the same inputs."""
        seqs = [seq for seq in batch.seqs if seq.draft_token_ids]
        copies = np.array(batch.block_copies, dtype=np.int64).reshape(-1, 2)  # a fresh private block: copy it first
        for step in range(max(len(seq.draft_token_ids) for seq in seqs)):
            seqs = [seq for seq in seqs if len(seq.draft_token_ids) > step]
            inputs = [seq.draft_token_ids[step - 1] if step else seq.token_ids[-1] for seq in seqs]
            positions = [seq.num_computed_tokens + step for seq in seqs]
            plan = decode_plan(seqs, inputs, positions, self.block_size, copies if step == 0 else NO_ROWS)
            for seq, token_id in zip(seqs, self.worker.execute(plan).token_ids()):
                seq.draft_token_ids[step] = token_id

    def mirror(self, plan: StepPlan, previous: StepOutput | None) -> None:
        """The target's plan, nothing sampled: the draft's cache takes the K/V of every position the target's does.
        Input tokens the step in flight sampled come from `previous` (the target's output) on the device."""
        self.worker.execute(
            dataclasses.replace(
                plan, sample_rows=NO_ROWS, sampling=None, prompt_logprob_rows=NO_ROWS, bitmask_rows=NO_ROWS
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


def decode_plan(
    seqs: list[Sequence], input_ids: list[int], positions: list[int], block_size: int, block_copies: np.ndarray
) -> StepPlan:
    """One token for each sequence at its position, through its block table, sampled greedily."""
    position = np.array(positions, dtype=np.int64)
    tables = block_table_array([seq.block_table for seq in seqs], max(len(seq.block_table) for seq in seqs))
    rows = np.arange(len(seqs))
    query_start_loc = np.arange(len(seqs) + 1, dtype=np.int32)
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
        sampling=StepSampling(build_sampling_batch([GREEDY] * len(seqs)), np.zeros(len(seqs), dtype=np.int64)),
        block_copies=block_copies,
    )
