"""The block manager of a paged KV cache that many requests share (vLLM's PagedAttention bookkeeping).

:class:`BlockManager` extends chapter 03's :class:`labkit.attention_variants.BlockAllocator` (free list, per-request
block tables and lengths) with what a server needs on top:

* **reference counts**: a block may sit in several block tables at once (a shared prompt prefix, a forked
  sequence); it returns to the free list only when the last table lets go of it;
* **copy-on-write**: a request about to write into a block that another table also holds gets a private copy
  first; the manager only does the bookkeeping and queues ``(source, destination)`` copies, which the engine
  applies to the K/V pools (:meth:`take_copies`) before the forward pass writes;
* **prefix caching**: a FULL block is named by a hash of (its parent block's hash, its token ids), so the same
  tokens after the same prefix get the same name. A new request's leading full blocks whose names are known are
  shared instead of recomputed. A freed block keeps its name while it waits on the free list, so a later request
  can still hit it; it is forgotten (evicted) only when the free list hands it out again, least recently freed
  first.
"""
from __future__ import annotations

from labkit.attention_variants import BlockAllocator, PoolExhaustedError, _check_int

__all__ = ["BlockManager", "PoolExhaustedError", "blocks_for"]

_ROOT_HASH = -1  # the "parent hash" of a sequence's first block


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks of ``block_size`` slots that ``num_tokens`` tokens occupy: ``ceil(num_tokens / block_size)``."""
    return -(-num_tokens // block_size)


class BlockManager(BlockAllocator):
    """Blocks of a paged KV cache shared by requests, with reference counts, copy-on-write and prefix caching.

    The interface of :class:`~labkit.attention_variants.BlockAllocator` (``add_sequence``, ``grow``, ``free``,
    ``block_tables``, ``lengths``, ``num_free_blocks``) plus :meth:`fork`, :meth:`refcount`, :meth:`take_copies`,
    :meth:`cached_prefix_length` and :meth:`allocate_cached_prefix`. Give ``grow`` the token ids it reserves slots
    for, and every block they fill becomes findable by later requests (``prefix_caching=True``)."""

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True):
        super().__init__(num_blocks, block_size)
        if not isinstance(prefix_caching, bool):
            raise TypeError(f"prefix_caching: expected a bool, got {type(prefix_caching).__name__}")
        self.prefix_caching = prefix_caching
        self._refcounts = [0] * num_blocks
        self._copies: list[tuple[int, int]] = []
        self._token_ids: dict = {}  # seq_id -> the token ids its filled slots hold (None where unknown)
        self._hashes: dict = {}  # seq_id -> the hash of each of its full blocks, in order
        self._cached: dict[int, int] = {}  # block hash -> block
        self._block_hash: dict[int, int] = {}  # block -> its hash (cached blocks only)
        self._block_tokens: dict[int, tuple] = {}  # block -> its token ids (to rule out hash collisions)
        self.hit_tokens = self.queried_tokens = 0

    # ------------------------------------------------------------------ state
    def refcount(self, block: int) -> int:
        """How many block tables hold ``block`` (0: it is on the free list)."""
        if isinstance(block, bool) or not isinstance(block, int) or not 0 <= block < self.num_blocks:
            raise ValueError(f"block={block!r}: expected an integer in [0, {self.num_blocks})")
        return self._refcounts[block]

    def num_shared_blocks(self, seq_id) -> int:
        """Blocks of ``seq_id``'s table that another table holds too (freeing ``seq_id`` would not free them)."""
        self._check_seq(seq_id)
        return sum(self._refcounts[b] > 1 for b in self.block_tables[seq_id])

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by at least one sequence."""
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks whose contents the prefix cache can find (in use or waiting on the free list)."""
        return len(self._cached)

    @property
    def hit_rate(self) -> float:
        """Fraction of the prompt tokens looked up by :meth:`allocate_cached_prefix` that the cache supplied."""
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0

    def take_copies(self) -> list[tuple[int, int]]:
        """The ``(source, destination)`` block copies that copy-on-write queued since the last call (and forget
        them): apply them to every layer's K and V before anything writes into the destinations."""
        copies, self._copies = self._copies, []
        return copies

    # ------------------------------------------------------------------ sequences
    def add_sequence(self, seq_id) -> None:
        """Start an empty sequence (no block is taken until it has tokens)."""
        super().add_sequence(seq_id)
        self._token_ids[seq_id], self._hashes[seq_id] = [], []

    def fork(self, parent_id, child_id) -> None:
        """Start ``child_id`` as a copy of ``parent_id`` that shares all its blocks (each refcount + 1): what
        parallel sampling or beam search does with a prompt. The first write either makes into a shared block
        copies it (copy-on-write)."""
        self._check_seq(parent_id)
        self.add_sequence(child_id)
        table = self.block_tables[parent_id]
        for block in table:
            self._refcounts[block] += 1
        self.block_tables[child_id] = list(table)
        self.lengths[child_id] = self.lengths[parent_id]
        self._token_ids[child_id] = list(self._token_ids[parent_id])
        self._hashes[child_id] = list(self._hashes[parent_id])

    def grow(self, seq_id, num_tokens: int, token_ids=None) -> list[tuple[int, int]]:
        """Reserve slots for ``num_tokens`` more tokens of ``seq_id``; returns their ``(block, offset)`` slots.

        If the first new slot lies in a block another table also holds, that block is first replaced by a fresh
        one (copy-on-write; the copy is queued for :meth:`take_copies`). ``token_ids`` (``num_tokens`` ints, or
        None) are the tokens the slots will hold: every block they complete gets its prefix-cache name. Raises
        :class:`PoolExhaustedError` (changing nothing) if the free list holds too few blocks."""
        self._check_seq(seq_id)
        _check_int(0, num_tokens=num_tokens)
        if token_ids is not None:
            token_ids = [int(t) for t in token_ids]
            if len(token_ids) != num_tokens:
                raise ValueError(f"token_ids: expected {num_tokens} ids (num_tokens), got {len(token_ids)}")
        table, length = self.block_tables[seq_id], self.lengths[seq_id]
        index = length // self.block_size  # the block the first new slot lies in
        writes_into_existing = num_tokens > 0 and index < len(table)
        writes_into_shared = writes_into_existing and self._refcounts[table[index]] > 1
        needed = blocks_for(length + num_tokens, self.block_size) - len(table) + writes_into_shared
        if needed > len(self._free):
            raise PoolExhaustedError(f"seq_id={seq_id!r} needs {needed} more block(s) of {self.block_size} tokens, "
                                     f"{len(self._free)} of {self.num_blocks} are free")
        if writes_into_shared:
            shared, private = table[index], self._take_free_block()
            self._refcounts[shared] -= 1  # still > 0: the other holders keep it
            table[index] = private
            self._copies.append((shared, private))
        elif writes_into_existing:
            self._forget(table[index])  # its contents are about to change: no longer what its name says
        before = len(table)
        slots = super().grow(seq_id, num_tokens)
        for block in table[before:]:
            self._forget(block)  # a block the cache still remembered is evicted now
            self._refcounts[block] = 1
        known = self._token_ids[seq_id]
        known.extend(token_ids if token_ids is not None else [None] * num_tokens)
        self._name_full_blocks(seq_id)
        return slots

    def free(self, seq_id) -> None:
        """``seq_id`` is done: each of its blocks loses a reference; those no table holds any more go back to the
        free list, where named blocks stay findable until the free list hands them out again."""
        self._check_seq(seq_id)
        released = []
        for block in self.block_tables.pop(seq_id):
            self._refcounts[block] -= 1
            if self._refcounts[block] == 0:
                released.append(block)
        # the free list hands out its END first: put released blocks at the front (least recently freed are
        # reused first), the sequence's last block nearest the end (a shared prefix is evicted last)
        self._free[0:0] = released
        del self.lengths[seq_id], self._token_ids[seq_id], self._hashes[seq_id]

    # ------------------------------------------------------------------ prefix caching
    def cached_prefix_length(self, token_ids) -> int:
        """How many leading tokens of ``token_ids`` the prefix cache holds now (whole blocks, at most
        ``len(token_ids) - 1``: the last token is always computed, its logits are needed). Changes nothing."""
        return min(len(self._cached_blocks(list(token_ids))) * self.block_size, max(len(token_ids) - 1, 0))

    def allocate_cached_prefix(self, seq_id, token_ids) -> int:
        """Give the empty sequence ``seq_id`` the cached blocks of ``token_ids``'s leading full blocks (each
        refcount + 1, taken off the free list if no one held it) and return how many tokens it thus has
        (:meth:`cached_prefix_length`). Counts toward :attr:`hit_rate`."""
        self._check_seq(seq_id)
        if self.block_tables[seq_id]:
            raise ValueError(f"seq_id={seq_id!r}: already holds blocks; a cached prefix is taken before anything else")
        token_ids = [int(t) for t in token_ids]
        blocks = self._cached_blocks(token_ids)
        cached = min(len(blocks) * self.block_size, max(len(token_ids) - 1, 0))
        blocks = blocks[:blocks_for(cached, self.block_size)]
        for block in blocks:
            if self._refcounts[block] == 0:
                self._free.remove(block)
            self._refcounts[block] += 1
        self.block_tables[seq_id] = list(blocks)
        self.lengths[seq_id] = cached
        self._token_ids[seq_id] = token_ids[:cached]
        self._hashes[seq_id] = [self._block_hash[b] for b in blocks[:cached // self.block_size]]
        self.hit_tokens += cached
        self.queried_tokens += len(token_ids)
        return cached

    def _cached_blocks(self, token_ids: list) -> list[int]:
        if not self.prefix_caching:
            return []
        blocks, parent, size = [], _ROOT_HASH, self.block_size
        for start in range(0, len(token_ids) - size + 1, size):
            tokens = tuple(token_ids[start:start + size])
            parent = hash((parent, tokens))
            block = self._cached.get(parent)
            if block is None or self._block_tokens[block] != tokens:
                break
            blocks.append(block)
        return blocks

    def _name_full_blocks(self, seq_id) -> None:
        if not self.prefix_caching:
            return
        hashes, tokens, size = self._hashes[seq_id], self._token_ids[seq_id], self.block_size
        table = self.block_tables[seq_id]
        for index in range(len(hashes), len(tokens) // size):
            block_tokens = tuple(tokens[index * size:(index + 1) * size])
            if None in block_tokens:
                return  # tokens not given: this block and every later one stay unnamed
            name = hash((hashes[-1] if hashes else _ROOT_HASH, block_tokens))
            hashes.append(name)
            if name not in self._cached:  # the first block computed with these contents keeps the name
                self._cached[name], self._block_hash[table[index]] = table[index], name
                self._block_tokens[table[index]] = block_tokens

    def _forget(self, block: int) -> None:
        name = self._block_hash.pop(block, None)
        if name is not None:
            del self._cached[name], self._block_tokens[block]

    def _take_free_block(self) -> int:
        block = self._free.pop()
        self._forget(block)
        self._refcounts[block] = 1
        return block
