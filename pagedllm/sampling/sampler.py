"""The vectorised sampler: one pass over a batch whose rows each have their own parameters, on the device.

Order: raw logprobs (before anything else, as vLLM's); a grammar's mask (structured outputs: disallowed tokens get
-inf); logit_bias and min_tokens' bans; penalties; greedy rows
take the argmax; the others divide by their temperature, keep what min-p, top-k and top-p allow (each on the
distribution the previous one left, renormalised) and draw. A row draws by the exponential race,
argmax(logits / T - log E) with E ~ Exp(1) per token, which samples softmax(logits / T) without computing it.
Seeded rows draw E from their own generator over the whole vocabulary, so their tokens do not depend on the batch.
A verify step's rows of drafts drawn from a distribution q take the rejection rule instead (rejection.py), on
sampling_probs, the distribution the race would draw from.

The kernel choices the sampler is built with say what runs (on CUDA by default: both of these). With `compile`, the
element-wise parts are compiled (layers/compile.py); Sampler.warmup() compiles each of them at start-up. With the
`triton_race` sampler, a batch that only races (no top-k, top-p or min-p, no seeded row) runs the race as one Triton
kernel that makes its noise in registers (kernels/race_sampling.py) instead of writing it to memory; on the H200 a
256-row decode step took 5.95 ms with it, 6.04 ms without, and it costs the host 0.19 ms a step against 0.23 ms
(benchmarks/NOTES.md). PAGEDLLM_FUSED_SAMPLER=0 takes the torch path, which draws the noise as for other batches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.layers.compile import fused, fusible
from pagedllm.layers.kernel_choices import TORCH_KERNELS, KernelChoices
from pagedllm.sampling.batch import SampledDraftTensors, SamplingBatch, SamplingTensors, build_sampling_batch
from pagedllm.sampling.logprobs import LogprobsTensors, compute_logprobs, copy_to_host
from pagedllm.sampling.params import SamplingParams
from pagedllm.sampling.rejection import rejection_rows
from pagedllm.sampling.state import PenaltyState, SeededGenerators
from pagedllm.structured_output.bitmask import apply_bitmask

# One batch for each compiled function: the exponential race, the race with min-p, penalise (on CUDA every mix of
# penalties runs one compiled signature); and the truncated path, which is not compiled but loads its kernels here.
WARMUP_PARAMS = (
    SamplingParams(temperature=0.8, seed=0),
    SamplingParams(temperature=0.8, min_p=0.1, seed=0),
    SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=0, presence_penalty=0.5),
    SamplingParams(temperature=0, frequency_penalty=0.5, repetition_penalty=1.1),
)


@dataclass(slots=True)
class TokenMask:
    """The grammar masks of a step's constrained rows, on the sampling device (Executor.execute's masks)."""

    bitmask: torch.Tensor  # [masked, bitmask_words] int32: bit t % 32 of word t // 32 allows token t
    rows: torch.Tensor  # [masked] int64: which logits row each masks, ascending


@dataclass(slots=True)
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [rows] int64
    logprobs: LogprobsTensors | None = None  # for SamplingBatch.logprob_rows, in that order
    probs: torch.Tensor | None = None  # [rows, vocab] float32 with SamplingBatch.return_probs: see sampling_probs

    def to_host(self, pin_memory: bool = False) -> SamplerOutput:
        """Start the copies to the host: to pinned memory, asynchronously, with `pin_memory` (record an event, sync
        it before reading); without, plain copies (none at all for tensors already on the host)."""
        logprobs = None if self.logprobs is None else self.logprobs.to_host(pin_memory)
        probs = None if self.probs is None else copy_to_host(self.probs, pin_memory)
        return SamplerOutput(copy_to_host(self.sampled_token_ids, pin_memory), logprobs, probs)


class Sampler:
    """Samples a step's rows and owns the per-request device state that sampling needs, keyed by request state index."""

    def __init__(
        self, num_states: int, vocab_size: int, device: torch.device, seed: int, kernels: KernelChoices = TORCH_KERNELS
    ):
        """kernels: which kernels sample (plain torch unless given; the worker passes the engine's choices)."""
        self.device, self.kernels = device, kernels
        self.penalties = PenaltyState(num_states, vocab_size, device, kernels)
        self.generators = SeededGenerators(device)
        self.default_generator = torch.Generator(device=device).manual_seed(seed)
        # Row -> its generator's state after the row's draw, for the seeded rows of the last verify step sampled.
        self.generator_states: dict[int, torch.Tensor] = {}

    def add_request(self, state_index: int, params: SamplingParams, prompt_token_ids: list[int]) -> None:
        if params.uses_penalties:
            self.penalties.add_request(state_index, prompt_token_ids)
        if params.seed is not None and not params.greedy:
            self.generators.add_request(state_index, params.seed)

    def release(self, state_index: int) -> None:
        self.penalties.release(state_index)
        self.generators.release(state_index)

    def take_back(self, rewinds: list[tuple[int, int]], uncounted: list[tuple[int, int]]) -> None:
        """Undo what the last step's rejected verify rows did to request state: each (state index, row) of rewinds
        puts that index's generator back to its state after the row's draw (the row of the last token it kept), and
        each (state index, token) of uncounted leaves the penalty counts."""
        for state_index, row in rewinds:
            self.generators.rewind(state_index, self.generator_states[row])
        if uncounted:
            state_indices, token_ids = torch.tensor(uncounted, dtype=torch.int64, device=self.device).unbind(1)
            self.penalties.uncount(state_indices, token_ids)

    @torch.inference_mode()  # as the worker's steps run: compiled code is guarded on the grad mode
    def warmup(self) -> None:
        """Run every compiled path at 1 row and at 2 rows (torch.compile specialises a batch of one row; 2 stands
        for every larger size), so that no step meets a compilation later. Takes state indices 0 and 1 and releases
        them: call it before any request is added. The batches are seeded, so the engine's own random stream is
        untouched."""
        for params in WARMUP_PARAMS:
            for num_rows in (1, 2):
                state_indices = list(range(num_rows))
                for state_index in state_indices:
                    self.add_request(state_index, params, prompt_token_ids=[0])
                batch = build_sampling_batch([params] * num_rows, state_indices, num_output_tokens=[0] * num_rows)
                self(torch.zeros(num_rows, self.penalties.vocab_size, device=self.device), batch)
                for state_index in state_indices:
                    self.release(state_index)
        if self.kernels.sampler == "triton_race":  # one Triton specialisation serves every batch size
            temperatures = torch.tensor([0.8, 0.0], device=self.device)
            logits = torch.zeros(len(temperatures), self.penalties.vocab_size, device=self.device)
            fused_race(logits, temperatures, torch.Generator(device=self.device).manual_seed(0))

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch, mask: TokenMask | None = None) -> SamplerOutput:
        """logits [rows, vocab] (a float32 input is modified in place) -> sampled ids and requested logprobs.
        mask: the rows a grammar constrains (None: no row is)."""
        if batch.on_device is None:
            batch.on_device = batch.to_device(
                self.device, self.generators.__getitem__, self.default_generator, self.kernels.pin_memory
            )
        tensors = batch.on_device
        states = {} if tensors.keep_generator_states else None
        output = sample_tokens(logits.float(), tensors, self.penalties, self.kernels, mask, states)
        if states is not None:
            self.generator_states = states
        return output


def sample_tokens(
    logits: torch.Tensor,
    params: SamplingTensors,
    penalty_state: PenaltyState | None = None,
    kernels: KernelChoices = TORCH_KERNELS,
    mask: TokenMask | None = None,
    generator_states: dict[int, torch.Tensor] | None = None,
) -> SamplerOutput:
    """logits [rows, vocab] float32 (modified in place) -> the sampled ids, and logprobs for the rows that asked.
    Logprobs are the model's (raw): taken before the grammar's mask, as before logit_bias and penalties.
    generator_states: filled with each seeded row's generator state after its draw, when given."""
    raw_logprobs = None
    if params.logprob_rows is not None:
        all_rows = len(params.logprob_rows) == len(logits)
        raw_logprobs = (logits if all_rows else logits.index_select(0, params.logprob_rows)).log_softmax(dim=-1)
    if mask is not None:
        # Ascending distinct rows as many as the logits' are every row in order: masked in place, without a gather.
        apply_bitmask(logits, mask.bitmask, None if len(mask.rows) == len(logits) else mask.rows)
    logits = process_logits(logits, params, penalty_state)
    probs = sampling_probs(logits, params) if params.return_probs else None
    sampled = choose_tokens(logits, params, kernels, generator_states)
    if params.sampled_drafts is not None:
        take_sampled_drafts(logits, sampled, params.sampled_drafts, generator_states)
    if params.penalties is not None:
        penalty_state.update(params.penalties, sampled)
    if raw_logprobs is None:
        return SamplerOutput(sampled, probs=probs)
    chosen = sampled if len(raw_logprobs) == len(sampled) else sampled.index_select(0, params.logprob_rows)
    return SamplerOutput(sampled, compute_logprobs(raw_logprobs, chosen, params.max_num_logprobs), probs)


def process_logits(
    logits: torch.Tensor, params: SamplingTensors, penalty_state: PenaltyState | None = None
) -> torch.Tensor:
    """What greedy rows take the argmax of: logits with logit_bias, min_tokens' bans and penalties applied."""
    if params.adjustments is not None:
        adjust = params.adjustments
        logits.index_put_((adjust.rows, adjust.token_ids), adjust.values, accumulate=True)
    if params.penalties is not None:
        assert penalty_state is not None, "a row has penalties but the sampler got no penalty state"
        logits = penalty_state.apply(logits, params.penalties)
    return logits


def sampling_probs(logits: torch.Tensor, params: SamplingTensors) -> torch.Tensor:
    """The distribution choose_tokens samples each non-greedy row of (processed) logits from: softmax(logits / T)
    over the tokens min-p, top-k and top-p keep (truncation_mask, in rank order), 0 elsewhere. A greedy row gets
    softmax(logits), which nothing samples."""
    scaled = logits / params.divisors[:, None]
    if params.top_ks is not None or params.top_ps is not None or params.min_ps is not None:
        sorted_logits, order = scaled.sort(dim=-1, descending=True)
        sorted_keep = truncation_mask(sorted_logits, params)
        keep = torch.empty_like(sorted_keep).scatter_(1, order, sorted_keep)  # back in token order
        scaled = scaled.masked_fill(~keep, -torch.inf)
    return scaled.softmax(dim=-1)


def take_sampled_drafts(
    logits: torch.Tensor,
    sampled: torch.Tensor,
    drafts: SampledDraftTensors,
    generator_states: dict[int, torch.Tensor] | None = None,
) -> None:
    """The tokens of the rows that verify sampled drafts, by the rejection rule, written into `sampled` (their
    batch sampled them as greedy rows). p is the rows' sampling_probs under their own settings. Each row draws
    vocab + 1 values of Exp(1) from its generator, in row order (the rows of one request one after the other, as
    exponential_noise draws): vocab for the residual's race, and one more, e, for the uniform exp(-e)."""
    distribution = drafts.distribution
    target = sampling_probs(logits.index_select(0, drafts.rows), distribution)
    states = None if generator_states is None else {}
    rows, vocab_size = target.shape
    noise = exponential_noise(target.new_empty(rows, vocab_size + 1), distribution, generator_states=states)
    uniforms = noise[:, -1].neg().exp()  # exp(-e) ~ U(0, 1) for e ~ Exp(1)
    tokens = rejection_rows(target, drafts.probs, drafts.token_ids, uniforms, noise[:, :-1])
    sampled.index_copy_(0, drafts.rows, tokens)
    if states:  # kept by the batch's rows
        generator_states.update({drafts.row_list[index]: state for index, state in states.items()})


def choose_tokens(
    logits: torch.Tensor,
    params: SamplingTensors,
    kernels: KernelChoices = TORCH_KERNELS,
    generator_states: dict[int, torch.Tensor] | None = None,
) -> torch.Tensor:
    if params.all_greedy:
        return logits.argmax(dim=-1)
    if kernels.sampler == "triton_race" and is_plain_race(params):
        return fused_race(logits, params.temperatures, params.default_generator)
    temperatures = params.divisors
    if params.top_ks is not None or params.top_ps is not None:
        sampled = sample_truncated(logits, temperatures, params, generator_states)
    else:
        noise = exponential_noise(logits, params, generator_states=generator_states)
        if params.min_ps is None:
            sampled = fused(exponential_race, kernels.compile)(logits, temperatures, noise)
        else:
            race = fused(exponential_race_min_p, kernels.compile)
            sampled = race(logits, temperatures, params.min_ps.log(), noise)
    if not params.any_greedy:
        return sampled
    return torch.where(params.temperatures > 0, sampled, logits.argmax(dim=-1))


def is_plain_race(params: SamplingTensors) -> bool:
    """Every row is greedy or races over the whole vocabulary with the engine's noise: no top-k, top-p or min-p, and
    no seeded row (a seeded row's draw must not depend on the path it is sampled in)."""
    return params.top_ks is None and params.top_ps is None and params.min_ps is None and not params.generators


def fused_race(logits: torch.Tensor, temperatures: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Greedy rows (temperature 0) and the race in one kernel. Its seed is drawn on the device from `generator`,
    so nothing waits for the host."""
    from pagedllm.kernels.race_sampling import race_sample  # imports Triton: only where the choices take this path

    seed = torch.randint(2**31 - 1, (1,), generator=generator, device=logits.device)
    return race_sample(logits, temperatures, seed)


@fusible
def exponential_race(logits: torch.Tensor, temperatures: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    return (logits / temperatures[:, None] - noise.log()).argmax(dim=-1)


@fusible
def exponential_race_min_p(
    logits: torch.Tensor, temperatures: torch.Tensor, log_min_ps: torch.Tensor, noise: torch.Tensor
) -> torch.Tensor:
    """min-p keeps p >= min_p * p_max, i.e. logit / T >= max(logit / T) + log(min_p): no softmax needed."""
    scaled = logits / temperatures[:, None]
    keep = scaled >= scaled.amax(dim=-1, keepdim=True) + log_min_ps[:, None]
    return (scaled - noise.log()).masked_fill(~keep, -torch.inf).argmax(dim=-1)


def sample_truncated(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    params: SamplingTensors,
    generator_states: dict[int, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Top-k / top-p (and min-p) rows: rank the tokens, mask in rank order, race over what is left."""
    scaled = logits / temperatures[:, None]
    vocab_size = scaled.shape[-1]
    if 0 < params.top_k_candidates <= vocab_size // 8:  # every row's top-k is small: no full sort needed
        candidate_logits, candidate_ids = scaled.topk(params.top_k_candidates, dim=-1)
    else:
        candidate_logits, candidate_ids = scaled.sort(dim=-1, descending=True)
    keep = truncation_mask(candidate_logits, params)
    noise = exponential_noise(candidate_logits, params, candidate_ids, vocab_size, generator_states)
    choice = (candidate_logits - noise.log()).masked_fill(~keep, -torch.inf).argmax(dim=-1)
    return candidate_ids.gather(1, choice[:, None]).squeeze(1)


def truncation_mask(sorted_logits: torch.Tensor, params: SamplingTensors) -> torch.Tensor:
    """sorted_logits [rows, n], descending -> which to keep. Each rule keeps a prefix, and the first token always."""
    ranks = torch.arange(sorted_logits.shape[-1], device=sorted_logits.device)
    keep = torch.ones_like(sorted_logits, dtype=torch.bool)
    if params.top_ks is not None:
        keep &= (params.top_ks[:, None] <= 0) | (ranks < params.top_ks[:, None])
    if params.min_ps is not None:
        keep &= sorted_logits >= sorted_logits[:, :1] + params.min_ps.log()[:, None]
    if params.top_ps is not None:
        # top-p on the distribution that top-k / min-p left: a token stays while the kept tokens more likely than it
        # hold less than top_p of that distribution's mass.
        probs = sorted_logits.masked_fill(~keep, -torch.inf).softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        keep &= mass_before < params.top_ps[:, None]
    return keep


def exponential_noise(
    like: torch.Tensor,
    params: SamplingTensors,
    candidate_ids: torch.Tensor | None = None,
    vocab_size: int | None = None,
    generator_states: dict[int, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Exp(1) noise shaped like `like`. A seeded row draws one value per vocabulary token from its own generator
    (then picks its candidates' values), so its draw is the same whichever path or batch it is sampled in; the rows
    of one generator draw in row order (a verify step's rows, one after the other). generator_states, when given,
    takes each seeded row's generator state after its draw."""
    noise = torch.empty_like(like, dtype=torch.float32)
    if len(params.generators) < len(like):  # some row has no generator of its own
        noise.exponential_(generator=params.default_generator)
    for row, generator in params.generators.items():
        if candidate_ids is None:
            noise[row].exponential_(generator=generator)
        else:
            row_noise = torch.empty(vocab_size, device=like.device).exponential_(generator=generator)
            noise[row] = row_noise.index_select(0, candidate_ids[row])
        if generator_states is not None:
            generator_states[row] = generator.get_state()
    return noise
