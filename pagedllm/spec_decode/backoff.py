"""Who speculates: a request whose drafts are seldom accepted stops for a while, and a large batch does not.

A verify step of 1 + m tokens costs more than a decode step of one; it pays when enough drafts are accepted. Its
cost is 1 + fixed + per_draft * m decode steps (VerifyCost), which depends on the kernel the projections and the LM
head run: on the default model on CPU, one sequence (`python benchmarks/speculative.py --cost`, benchmarks/NOTES.md),
float weights (in panels, layers/cpu_float_gemm.cpp) 0.15 a draft from the first (0.09-0.11 at m = 1, 0.47-0.61 at
4, 0.69-0.89 at 6: two runs, session 32; the line stays at or above them, so back-off pauses sooner than it must,
never later), GGUF blocks kept 0.5 a draft from the first (0.44-0.55 at m = 1..8, two runs, since session 28's
decode stack took a third off a one-row step and nothing off a draft: the grouped-integer kernel's work grows with
its rows). Accepting a of m drafts
saves a decode steps, so a verify pays when a > fixed + per_draft * m. Over a window of a request's last WINDOW
verify steps, fewer accepted drafts than that sum pauses the request's speculation; so do WINDOW attempts in a row
that proposed nothing (lookups cost host time; under async scheduling a request that may speculate keeps steps
synchronous). A pause lasts PAUSE_TOKENS of the request's output tokens (counted in tokens, not calls, so that steps
scheduled ahead without proposing count too), twice as long after each pause, up to MAX_PAUSE_TOKENS; then it tries
again with an empty window. Larger batches cost more per draft (at 8 sequences a draft cost 0.4 decode steps): above
SpeculativeConfig.disable_by_batch_size running sequences none speculates.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pagedllm.scheduler.sequence import Sequence

WINDOW = 8  # verify steps whose acceptance is judged together (and attempts without a proposal before a pause)
PAUSE_TOKENS = 16
MAX_PAUSE_TOKENS = 512


@dataclass(frozen=True, slots=True)
class VerifyCost:
    """Decode steps a verify step costs beyond its own: fixed whatever its drafts, and per_draft for each."""

    fixed: float
    per_draft: float

    def break_even(self, window: deque[tuple[int, int]]) -> float:
        """The accepted drafts that pay for the window's verify steps."""
        return sum(self.fixed + self.per_draft * proposed for proposed, _ in window)


FLOAT_WEIGHTS = VerifyCost(0.0, 0.15)
INT4_BLOCKS = VerifyCost(0.0, 0.5)  # GGUF blocks kept quantized (layers/quantization/gguf.py)


def verify_cost(quantization: str | None) -> VerifyCost:
    """The cost of the linear layers' weight format that runs (KernelChoices.quantization). Measured on CPU only: on
    a GPU the float line is kept (a verify step there costs less, so back-off pauses sooner than it must, never
    later)."""
    return INT4_BLOCKS if quantization == "gguf" else FLOAT_WEIGHTS


@dataclass(slots=True)
class SpeculationState:
    """One sample's record (Sequence.speculation)."""

    window: deque[tuple[int, int]] = field(default_factory=lambda: deque(maxlen=WINDOW))  # (proposed, accepted)
    attempts_without_drafts: int = 0
    resume_at: int = 0  # the number of output tokens from which it may speculate again
    num_pauses: int = 0


def state_of(seq: Sequence) -> SpeculationState:
    if seq.speculation is None:
        seq.speculation = SpeculationState()
    return seq.speculation


def may_speculate(seq: Sequence) -> bool:
    """False while seq's speculation is paused."""
    return seq.speculation is None or seq.num_output_tokens >= seq.speculation.resume_at


def observe(seq: Sequence, num_proposed: int, num_accepted: int, cost: VerifyCost = FLOAT_WEIGHTS) -> None:
    """One attempt: num_proposed drafts (0: the proposer found none), num_accepted of them kept."""
    state = state_of(seq)
    if num_proposed == 0:
        state.attempts_without_drafts += 1
        if state.attempts_without_drafts >= WINDOW:
            pause(seq, state)
        return
    state.attempts_without_drafts = 0
    state.window.append((num_proposed, num_accepted))
    if len(state.window) == WINDOW and sum(a for _, a in state.window) < cost.break_even(state.window):
        pause(seq, state)


def pause(seq: Sequence, state: SpeculationState) -> None:
    state.resume_at = seq.num_output_tokens + min(PAUSE_TOKENS << state.num_pauses, MAX_PAUSE_TOKENS)
    state.num_pauses += 1
    state.window.clear()
    state.attempts_without_drafts = 0
