"""Prompts that share blocks another prompt computes in the same step: the later one waits a step and finds them
cached, instead of computing them a second time; a short shared start is not worth the wait."""

from __future__ import annotations

from pagedllm.sampling.params import SamplingParams
from pagedllm.scheduler.block_manager import BlockManager
from pagedllm.scheduler.scheduler import Scheduler
from pagedllm.scheduler.sequence import Sequence

BLOCK = 16


def make_scheduler(enable_prefix_caching: bool = True, budget: int = 4096) -> Scheduler:
    manager = BlockManager(num_blocks=256, block_size=BLOCK, enable_prefix_caching=enable_prefix_caching)
    return Scheduler(manager, max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=1024)


def request(name: str, token_ids: list[int]) -> Sequence:
    return Sequence(name, list(token_ids), SamplingParams(max_tokens=4))


def scheduled_tokens(scheduler: Scheduler) -> dict[str, int]:
    batch = scheduler.schedule()
    scheduler.advance(batch)
    return {seq.request_id: n for seq, n in zip(batch.seqs, batch.num_new_tokens)}


SHARED = list(range(1000, 1000 + 8 * BLOCK))  # 8 blocks


def test_a_prompt_sharing_this_steps_blocks_waits_a_step_and_finds_them_cached():
    scheduler = make_scheduler()
    first, second = request("a", SHARED + [1, 2, 3]), request("b", SHARED + [4, 5, 6, 7, 8])
    unrelated = request("c", list(range(50, 90)))
    for seq in (first, second, unrelated):
        scheduler.add(seq)
    assert scheduled_tokens(scheduler) == {"a": len(first.token_ids), "c": len(unrelated.token_ids)}
    assert [seq.request_id for seq in scheduler.waiting] == ["b"]  # the requests behind it went on
    assert scheduled_tokens(scheduler) == {"b": 5}
    assert second.num_cached_tokens == len(SHARED)


def test_prompts_computed_in_one_step_share_nothing_without_prefix_caching():
    scheduler = make_scheduler(enable_prefix_caching=False)
    first, second = request("a", SHARED + [1, 2, 3]), request("b", SHARED + [4, 5, 6, 7, 8])
    scheduler.add(first)
    scheduler.add(second)
    assert scheduled_tokens(scheduler) == {"a": len(first.token_ids), "b": len(second.token_ids)}


def test_a_short_shared_start_is_not_worth_a_step():
    """One shared block of a prompt of 7 blocks: under a quarter of what it computes, so it runs at once."""
    scheduler = make_scheduler()
    start = SHARED[:BLOCK]
    first, second = request("a", start + list(range(6 * BLOCK))), request("b", start + list(range(1, 6 * BLOCK + 1)))
    scheduler.add(first)
    scheduler.add(second)
    assert scheduled_tokens(scheduler) == {"a": 7 * BLOCK, "b": 7 * BLOCK}


def test_a_prompt_waits_for_the_chunk_of_a_longer_prompt_still_in_prefill():
    """Budget 64: the long prompt computes 64 tokens a step; the one sharing its start waits for each chunk it
    shares, then computes only its own tail."""
    scheduler = make_scheduler(budget=64)
    long, short = request("long", SHARED + list(range(40))), request("short", SHARED + [7, 7, 7])
    scheduler.add(long)
    scheduler.add(short)
    assert scheduled_tokens(scheduler) == {"long": 64}
    assert scheduled_tokens(scheduler) == {"long": 64}  # short would take the second chunk's blocks again: it waits
    assert scheduled_tokens(scheduler) == {"long": 40, "short": 3}
    assert short.num_cached_tokens == len(SHARED)
