"""Prefix caching: the KV cache of prompt blocks already computed, reused by later prompts.

    cache = PrefixCache(session, block_tokens=16, capacity_tokens=8192)
    hit, arrays = cache.lookup(ids)        # the longest cached prefix of whole blocks
    ... session.resume(slot, arrays, hit, ids[hit:]) instead of session.prefill(slot, ids) ...
    cache.insert(slot, ids)                # the prompt's whole blocks, from the slot's cache

A block is `block_tokens` tokens; it is named by a hash of its tokens and of the block before it
(so a block is only ever reused after the same prefix, as vLLM's automatic prefix caching does),
and holds its positions of every cache input. The least recently used blocks are dropped first
beyond `capacity_tokens`. The last prompt token is always computed: its logits choose the first
new token. Queries and hits are counted in tokens (`queries`, `hits`).
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

Block = dict[str, np.ndarray]


class PrefixCache:
    def __init__(self, session: Session, *, block_tokens: int = 16, capacity_tokens: int = 8192) -> None:
        if block_tokens < 1 or capacity_tokens < block_tokens:
            raise OptionError(f"a prefix cache needs blocks of >= 1 token and room for one block "
                              f"(got {block_tokens} and {capacity_tokens})")
        self.session = session
        self.axes = {pair.past: pair.axis for pair in session._require_cache().pairs}
        self.block_tokens, self.capacity_blocks = block_tokens, capacity_tokens // block_tokens
        self.blocks: OrderedDict[bytes, Block] = OrderedDict()
        self.queries = self.hits = 0

    def _keys(self, ids: Sequence[int], limit: int) -> list[bytes]:
        """The chained hashes of the whole blocks among the first `limit` tokens."""
        keys, parent = [], b""
        for start in range(0, limit - self.block_tokens + 1, self.block_tokens):
            block = np.asarray(ids[start:start + self.block_tokens], dtype=np.int64).tobytes()
            parent = hashlib.blake2b(parent + block, digest_size=16).digest()
            keys.append(parent)
        return keys

    def lookup(self, ids: Sequence[int]) -> tuple[int, Block]:
        """(tokens reused, their cache arrays) for the longest cached prefix of whole blocks of
        `ids` that leaves its last token to compute; (0, {}) when none."""
        self.queries += len(ids)
        found: list[Block] = []
        keys = []
        for key in self._keys(ids, len(ids) - 1):
            block = self.blocks.get(key)
            if block is None:
                break
            keys.append(key)
            found.append(block)
        self._touch(keys)
        if not found:
            return 0, {}
        tokens = len(found) * self.block_tokens
        self.hits += tokens
        return tokens, {name: np.concatenate([b[name] for b in found], axis=axis) for name, axis in self.axes.items()}

    def insert(self, slot: int, ids: Sequence[int]) -> None:
        """Keep the whole blocks of `ids` (the prompt sequence `slot` now holds) not cached yet."""
        keys = self._keys(ids, len(ids))[:self.capacity_blocks]
        for index, key in enumerate(keys):
            if key not in self.blocks:
                start = index * self.block_tokens
                self.blocks[key] = self.session.prefix(slot, start, start + self.block_tokens)
        self._touch(keys)
        while len(self.blocks) > self.capacity_blocks:
            self.blocks.popitem(last=False)

    def _touch(self, chain: list[bytes]) -> None:
        """Mark a chain used, its first block most recently: a chain is evicted from its end, and a
        block is only reachable through the ones before it."""
        for key in reversed(chain):
            self.blocks.move_to_end(key)
