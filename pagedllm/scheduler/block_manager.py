"""Paged KV blocks with reference counts, and the prefix cache: full blocks found again by a chained content hash.

A block is either held (ref_count > 0, in some sequences' block tables) or free (ref_count == 0, in
free_block_ids). A free block keeps its hash and tokens, so a later request with the same prefix can take it
back; free blocks are handed out oldest-freed first (LRU), and blocks with no hash go first of all.
Samples of one request (n > 1) share their prompt's blocks; a shared block that is not full is copied before a
sequence writes into it (copy-on-write: the copies are queued in pending_copies and run before the step).
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

import xxhash

from pagedllm.scheduler.sequence import Sequence


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None  # hash of this block's tokens chained with every block before it
    token_ids: tuple[int, ...] = ()  # kept to tell a true hit from a hash collision


def chained_block_hash(previous_hash: int | None, token_ids: list[int] | tuple[int, ...]) -> int:
    hasher = xxhash.xxh64()
    if previous_hash is not None:
        hasher.update(previous_hash.to_bytes(8, "little"))
    hasher.update(array("q", token_ids).tobytes())
    return hasher.intdigest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(block_id) for block_id in range(num_blocks)]
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # front = evict first
        self.cached_block_ids: dict[int, int] = {}  # hash -> id of a block holding exactly those tokens
        # (source, destination) block ids whose K/V the device must copy before the next step runs.
        self.pending_copies: list[tuple[int, int]] = []

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Ids of cached blocks matching seq's leading full blocks. The last token is never taken from the cache:
        it must be computed so the step has logits to sample from."""
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        for index, block_hash in enumerate(self.full_block_hashes(seq.token_ids, 0, seq.num_tokens - 1, None)):
            block_id = self.cached_block_ids.get(block_hash)
            token_ids = tuple(seq.token_ids[index * self.block_size : (index + 1) * self.block_size])
            if block_id is None or self.blocks[block_id].token_ids != token_ids:
                break
            hits.append(block_id)
        return hits

    def full_block_hashes(
        self, token_ids: list[int], first: int, end_token: int, previous_hash: int | None
    ) -> Iterator[int]:
        """The chained hashes of the full blocks of token_ids from block index `first` on, up to those within the
        first end_token tokens; previous_hash: block first - 1's (hash_before). The one definition of the chain:
        the cache indexes blocks by it and looks them up by it."""
        for start in range(first * self.block_size, end_token - self.block_size + 1, self.block_size):
            previous_hash = chained_block_hash(previous_hash, token_ids[start : start + self.block_size])
            yield previous_hash

    def hash_before(self, block_ids, index: int) -> int | None:
        """The hash of block_ids[index - 1] (a hashed block), or None at index 0: where a chain from index goes on."""
        return self.blocks[block_ids[index - 1]].hash if index else None

    def take_cached_prefix(self, seq: Sequence, block_ids: list[int]) -> None:
        assert not seq.block_table, "a sequence takes cached blocks only when it holds none"
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_block_ids[block_id]
            block.ref_count += 1
        seq.block_table = array("i", block_ids)
        seq.num_hashed_blocks = len(block_ids)
        seq.num_computed_tokens = len(block_ids) * self.block_size

    def allocate_blocks_for(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Grow seq's block table to hold num_new_tokens more; False (and no change) if there are too few free.
        A partly filled last block that other sequences share is first replaced by a private copy."""
        needed = self.blocks_for_tokens(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        shared_index = self.shared_partial_block(seq)
        if needed + (shared_index is not None) > len(self.free_block_ids):
            return False
        if shared_index is not None:
            self._copy_on_write(seq, shared_index)
        for _ in range(needed):
            seq.block_table.append(self._allocate_free_block())
        return True

    def shared_partial_block(self, seq: Sequence) -> int | None:
        """The index of the block seq writes next, if that block is partly filled and shared with another sample."""
        if seq.num_computed_tokens % self.block_size == 0:
            return None  # the next token starts a block of its own
        index = seq.num_computed_tokens // self.block_size
        return index if self.blocks[seq.block_table[index]].ref_count > 1 else None

    def _copy_on_write(self, seq: Sequence, index: int) -> None:
        shared = self.blocks[seq.block_table[index]]
        shared.ref_count -= 1  # still > 0: the other holders keep it
        copy = self._allocate_free_block()
        seq.block_table[index] = copy
        self.pending_copies.append((shared.block_id, copy))

    def take_pending_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """child shares every block of parent (whose tokens it has): reference counts go up, nothing is copied."""
        assert not child.block_table, "a sequence forks only when it holds no blocks"
        for block_id in parent.block_table:
            self.blocks[block_id].ref_count += 1
        child.block_table = array("i", parent.block_table)
        child.num_hashed_blocks = parent.num_hashed_blocks
        child.num_computed_tokens = parent.num_computed_tokens

    def _allocate_free_block(self) -> int:
        block_id, _ = self.free_block_ids.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None and self.cached_block_ids.get(block.hash) == block_id:
            del self.cached_block_ids[block.hash]
        block.hash, block.token_ids, block.ref_count = None, (), 1
        return block_id

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Index the blocks that became full of computed tokens, so later requests can reuse them."""
        num_full_blocks = seq.num_computed_tokens // self.block_size
        if num_full_blocks <= seq.num_hashed_blocks or not self.enable_prefix_caching:
            return  # most steps: no block became full
        first = seq.num_hashed_blocks
        previous_hash = self.hash_before(seq.block_table, first)
        hashes = self.full_block_hashes(seq.token_ids, first, num_full_blocks * self.block_size, previous_hash)
        for index, block_hash in enumerate(hashes, first):
            block = self.blocks[seq.block_table[index]]
            block.hash = block_hash
            block.token_ids = tuple(seq.token_ids[index * self.block_size : (index + 1) * self.block_size])
            self.cached_block_ids.setdefault(block_hash, block.block_id)
        seq.num_hashed_blocks = max(seq.num_hashed_blocks, num_full_blocks)

    def free(self, seq: Sequence) -> None:
        """Release seq's blocks, last block first, so a shared prefix outlives the tails that extend it."""
        for block_id in reversed(seq.block_table):
            self._release(block_id)
        seq.block_table = array("i")
        seq.num_hashed_blocks = 0
        seq.num_computed_tokens = 0

    def trim(self, seq: Sequence) -> None:
        """Release the blocks past those seq's computed tokens fill: the lookahead of a verify step whose drafts were
        rejected. Such a block holds no computed token, so it was never hashed, and no other sequence holds it (a
        fork shares only blocks of computed tokens)."""
        keep = self.blocks_for_tokens(seq.num_computed_tokens)
        while len(seq.block_table) > keep:
            self._release(seq.block_table.pop())

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        assert block.ref_count >= 0, f"block {block_id} freed more often than taken"
        if block.ref_count == 0:
            self.free_block_ids[block_id] = None
            if block.hash is None:  # nothing to reuse: hand it out before any cached block
                self.free_block_ids.move_to_end(block_id, last=False)

    def reset_prefix_cache(self) -> None:
        """Forget every cached block that no request holds (held blocks stay indexed)."""
        for block_id in self.free_block_ids:
            block = self.blocks[block_id]
            if block.hash is not None and self.cached_block_ids.get(block.hash) == block_id:
                del self.cached_block_ids[block.hash]
            block.hash, block.token_ids = None, ()

    def check_invariants(self, holders: list[Sequence]) -> None:
        """Every block is free xor held; reference counts equal the number of block tables holding the block."""
        held: dict[int, int] = {}
        for seq in holders:
            for block_id in seq.block_table:
                held[block_id] = held.get(block_id, 0) + 1
        for block in self.blocks:
            assert block.ref_count == held.get(block.block_id, 0), f"block {block.block_id} ref_count mismatch"
            assert (block.ref_count == 0) == (block.block_id in self.free_block_ids), f"block {block.block_id}"
        for block_hash, block_id in self.cached_block_ids.items():
            assert self.blocks[block_id].hash == block_hash, f"stale prefix-cache entry for block {block_id}"
