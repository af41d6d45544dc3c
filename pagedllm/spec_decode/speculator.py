"""The speculator: what the step protocol asks of speculative decoding, around each step.

Before scheduling, propose: each running sequence that may verify (its last token is its only uncomputed one and
is known, it may grow by two tokens or more, back-off does not hold it) gets draft_token_ids: the n-gram lookup's
tokens, filtered by its grammar (the prefix the grammar allows), or k PLACEHOLDERs that the draft model fills after
scheduling, once the drafts have their slots (fill). After the step is launched, the draft model runs the same plan
(mirror), so its KV cache holds what the target's holds. After the tokens are read back, accept: each verifying
sequence keeps its accepted drafts and one more token (acceptance.py), and back-off sees how it went.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.config import ResolvedConfig, SpeculativeConfig
from pagedllm.executor.kv_cache import CompanionMemory
from pagedllm.executor.step_output import StepOutput
from pagedllm.executor.step_plan import StepPlan
from pagedllm.scheduler.scheduler import ScheduledBatch, Scheduler
from pagedllm.scheduler.sequence import PLACEHOLDER, Sequence
from pagedllm.spec_decode import backoff
from pagedllm.spec_decode.acceptance import accepted_tokens
from pagedllm.spec_decode.draft_model import DraftModel
from pagedllm.spec_decode.ngram import NgramProposer

# StepRecord.speculation: what this step's proposal did.
VERIFIED = "verified"  # some sequence verified drafts
NONE_PROPOSED = "none proposed"  # sequences could speculate, but the proposer found nothing (or back-off held them)
BATCH_TOO_LARGE = "batch above disable_by_batch_size"
NOT_PROPOSED = "not proposed"  # a step scheduled while another was in flight (its sequences hold placeholders)


@dataclass(slots=True)
class Proposal:
    choice: str  # one of the names above (VERIFIED once the schedule kept some drafts)
    num_paused: int = 0  # sequences that could speculate but back-off held


@dataclass(slots=True)
class Verified:
    """One sequence's verify rows, read back."""

    seq: Sequence
    num_drafts: int
    tokens: list[int]  # the accepted drafts and the token after them


class Speculator:
    def __init__(self, config: SpeculativeConfig, draft: DraftModel | None = None, cost=backoff.FLOAT_WEIGHTS):
        self.config = config
        self.draft = draft
        self.cost = cost  # what a verify step costs with the target's kernels (back-off's break-even)
        self.ngram = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max) if draft is None else None

    def memory(self) -> CompanionMemory | None:
        """What the draft model will take on the device beside the target's cache; None for n-gram lookup."""
        return self.draft.memory() if self.draft is not None else None

    def start(self, num_kv_blocks: int) -> None:
        """Once the target's cache is sized: a draft model loads, with a KV cache of as many blocks."""
        if self.draft is not None:
            self.draft.start(num_kv_blocks)

    def propose(self, scheduler: Scheduler) -> Proposal:
        limit = self.config.disable_by_batch_size
        if limit is not None and len(scheduler.running) > limit:
            return Proposal(BATCH_TOO_LARGE)
        proposal = Proposal(NONE_PROPOSED)
        for seq in scheduler.running:
            if not can_verify(seq):
                continue
            if not backoff.may_speculate(seq):
                proposal.num_paused += 1
                continue
            num_drafts = min(self.config.num_speculative_tokens, seq.max_num_tokens - seq.num_tokens - 1)
            if self.draft is not None:
                if seq.grammar is None:  # a draft model's drafts are known only after scheduling: none to filter
                    seq.draft_token_ids = [PLACEHOLDER] * num_drafts
                continue
            drafts = self.ngram.propose(seq.token_ids, num_drafts)
            if seq.grammar is not None:
                drafts = grammar_allowed_prefix(seq.grammar.matcher, drafts)
            if drafts:
                seq.draft_token_ids = drafts
            else:
                backoff.observe(seq, 0, 0, self.cost)
        return proposal

    def may_verify_soon(self, scheduler: Scheduler) -> bool:
        """Some running sequence may verify drafts once the step in flight is back (under async scheduling the
        pipeline then settles that step first: a sequence holding a placeholder cannot propose)."""
        limit = self.config.disable_by_batch_size
        if limit is not None and len(scheduler.running) > limit:
            return False
        return any(
            not seq.forks and seq.max_num_tokens - len(seq.token_ids) >= 2 and backoff.may_speculate(seq)
            for seq in scheduler.running
        )

    def fill(self, batch: ScheduledBatch) -> None:
        """After scheduling: the draft model's drafts for the sequences that verify (n-gram drafts are known)."""
        if self.draft is not None:
            self.draft.propose(batch)

    def mirror(self, plan: StepPlan, previous: StepOutput | None) -> None:
        """After the target's step is launched: the draft model computes the same positions into its own cache."""
        if self.draft is not None:
            self.draft.mirror(plan, previous)

    def accept(self, seq: Sequence, sampled: list[int]) -> Verified:
        """seq's verify rows' tokens -> what it keeps; back-off counts the attempt."""
        drafts = seq.draft_token_ids
        seq.draft_probs = None  # verified: the drafts' distributions are not needed again
        tokens = accepted_tokens(sampled, drafts)
        if drafts:
            backoff.observe(seq, len(drafts), len(tokens) - 1, self.cost)
        return Verified(seq, len(drafts), tokens)

    def shutdown(self) -> None:
        if self.draft is not None:
            self.draft.shutdown()


def make_speculator(resolved: ResolvedConfig, spec, tokenizer) -> Speculator | None:
    """The engine's speculator (None without speculative_config), made before the target starts: a draft model is
    opened and checked now, and loaded by Speculator.start. spec, tokenizer: the target's (DecoderSpec; None
    without one)."""
    config = resolved.speculative
    if config is None:
        return None
    draft = DraftModel(resolved, spec, tokenizer) if config.method == "draft_model" else None
    return Speculator(config, draft, backoff.verify_cost(resolved.kernels.quantization))


def can_verify(seq: Sequence) -> bool:
    """seq's one uncomputed token is its last, known on the host (no placeholder), its samples have forked, and it may
    still grow by two tokens: a verify step would yield a draft and the token after it."""
    return (
        seq.num_computed_tokens == len(seq.token_ids) - 1
        and seq.pending_sample_index < 0
        and not seq.forks
        and seq.max_num_tokens - len(seq.token_ids) >= 2
    )


def grammar_allowed_prefix(matcher, drafts: list[int]) -> list[int]:
    """The drafts the grammar allows one after the other, up to the first it refuses (or the end of the output); the
    matcher is left as it was."""
    allowed = 0
    for token_id in drafts:
        if matcher.is_terminated() or not matcher.accept_token(token_id):
            break
        allowed += 1
    matcher.rollback(allowed)
    return drafts[:allowed]
