"""Speculative decoding's figures, summed over step records (StepRecord.num_drafts, num_draft_tokens,
num_accepted_tokens), as vLLM names them: drafts (a sequence verifying drafts in a step), draft tokens, accepted
tokens; the acceptance rate (accepted / draft tokens) and the mean accepted length (tokens a verify step yields for a
sequence: its accepted drafts and the token after them)."""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.trace.step_record import StepRecord


@dataclass(slots=True)
class SpecDecodeStats:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def add(self, record: StepRecord) -> None:
        """A step listener (LLMEngine.add_step_listener)."""
        self.num_drafts += record.num_drafts
        self.num_draft_tokens += record.num_draft_tokens
        self.num_accepted_tokens += record.num_accepted_tokens

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
