"""Prefix caching: the KV blocks of prompts already computed, shared by later prompts.

    cache = PrefixCache(session, capacity_tokens=8192)
    hit, blocks = cache.lookup(ids)        # the longest cached prefix of whole blocks
    ... session.attach(slot, blocks, hit, ids[hit:]) instead of session.prefill(slot, ids) ...
    cache.insert(slot, ids)                # the prompt's whole blocks, shared from the slot's table

A cached block is a block of the session's pool (`aviatorc.runtime.paged`), held by the cache
as one more reference: a sequence that starts from it shares it, copy-on-write, and nothing is
copied (a shared block is never written: a sequence's next position starts a block of its own).
A block is named by a hash of its tokens and of the block before it (so it is only ever reused
after the same prefix, as vLLM's automatic prefix caching does). Beyond `capacity_tokens` the
least recently used blocks are dropped first, and `evict` gives blocks back to the pool when it
runs short: cached blocks use memory no sequence needs, so they go before any sequence is
preempted. The last prompt token is always computed: its logits choose the first new token.
Queries and hits are counted in tokens (`queries`, `hits`).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from aviatorc.errors import OptionError

if TYPE_CHECKING:
    from aviatorc.runtime import Session


class PrefixCache:
    def __init__(self, session: Session, *, capacity_tokens: int | None = None) -> None:
        pool = session._kv()
        self.session, self.pool = session, pool
        self.block_tokens = pool.block_size
        capacity_tokens = pool.num_blocks * pool.block_size if capacity_tokens is None else capacity_tokens
        if capacity_tokens < self.block_tokens:
            raise OptionError(f"a prefix cache needs room for one block of {self.block_tokens} tokens "
                              f"(got {capacity_tokens})")
        self.capacity_blocks = capacity_tokens // self.block_tokens
        self.blocks: OrderedDict[bytes, int] = OrderedDict()  # chained hash -> the pool's block
        self.queries = self.hits = 0

    def _keys(self, ids: Sequence[int], limit: int) -> list[bytes]:
        """The chained hashes of the whole blocks among the first `limit` tokens."""
        keys, parent = [], b""
        for start in range(0, limit - self.block_tokens + 1, self.block_tokens):
            block = np.asarray(ids[start:start + self.block_tokens], dtype=np.int64).tobytes()
            parent = hashlib.blake2b(parent + block, digest_size=16).digest()
            keys.append(parent)
        return keys

    def lookup(self, ids: Sequence[int]) -> tuple[int, list[int]]:
        """(tokens reused, their blocks) for the longest cached prefix of whole blocks of `ids`
        that leaves its last token to compute; (0, []) when none."""
        self.queries += len(ids)
        keys: list[bytes] = []
        for key in self._keys(ids, len(ids) - 1):
            if key not in self.blocks:
                break
            keys.append(key)
        self._touch(keys)
        self.hits += len(keys) * self.block_tokens
        return len(keys) * self.block_tokens, [self.blocks[key] for key in keys]

    def insert(self, slot: int, ids: Sequence[int]) -> None:
        """Share the whole blocks of `ids` (the prompt sequence `slot` now holds) not cached yet."""
        keys = self._keys(ids, len(ids))[:self.capacity_blocks]
        table = self.session.blocks_of(slot)
        for index, key in enumerate(keys):
            if key not in self.blocks:
                self.blocks[key] = self.pool.share([table[index]])[0]
        self._touch(keys)
        while len(self.blocks) > self.capacity_blocks:
            self.pool.release([self.blocks.popitem(last=False)[1]])

    def evict(self, blocks: int) -> int:
        """Give back up to `blocks` blocks that only the cache holds, least recently used first;
        how many went back to the pool."""
        freed = 0
        for key in list(self.blocks):
            if freed >= blocks:
                break
            block = self.blocks[key]
            if self.pool.refs[block] == 1:
                del self.blocks[key]
                self.pool.release([block])
                freed += 1
        return freed

    def _touch(self, chain: list[bytes]) -> None:
        """Mark a chain used, its first block most recently: a chain is evicted from its end, and a
        block is only reachable through the ones before it."""
        for key in reversed(chain):
            self.blocks.move_to_end(key)
