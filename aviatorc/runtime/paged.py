"""Every sequence's KV cache in fixed-size blocks from one pool, as paged serving stacks keep it.

    pool = KVPool(specs, num_blocks=256, block_size=16, int8=False)
    table: list[int] = []                      # a sequence's block table
    pool.reserve(table, start, stop)           # blocks for positions [start, stop), this table's alone
    pool.write(table, name, start, values)     # one cache input's positions from `start` (a batch-1 array)
    pool.read(table, name, stop)               # its positions [0, stop), as the graph reads them
    pool.release(table, keep)                  # the blocks past `keep` positions go back to the pool
    pool.share(blocks)                         # one more holder of those blocks (a cached prefix)

The plan keeps the pool's first `sram_blocks` blocks in SRAM and streams the rest from LPDDR
(`aviatorc.schedule.memory.kv_in_free_sram`); the lowest free block is taken first, so the blocks
in use are the ones on chip as far as they go.

A block holds `block_size` positions of every cache input (each layer's K and V), as vLLM's do, so
one table serves them all. Blocks are counted references: a prefix cache and any number of
sequences may hold the same block, and a write into a shared block copies it first
(copy-on-write, in `reserve`). A pool that cannot give the blocks asked for raises `OutOfBlocks`
before anything changes, so a step that cannot have its room runs not at all.

Under `int8` a block keeps int8 codes and one fp16 scale per head and token (`aviatorc.quant.kv`):
the layout the plan's prediction counts (`kv_dtype="int8"`). Only the positions a step adds are
quantized; the ones before stay the codes they were, so a long sequence does not drift by
requantizing its past, and dequantized positions written back (a swapped or cached prefix)
requantize to the same codes.

The pool's arrays are allocated zeroed and untouched (the operating system maps a page when it is
first written), so a pool sized for the plan's whole context costs host memory only as it fills.
"""

from __future__ import annotations

import heapq
import math
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from aviatorc.errors import AviatorError
from aviatorc.quant.kv import dequantize_kv, quantize_kv


class OutOfBlocks(AviatorError):
    """The pool has fewer free blocks than asked for. `needed`, `free` and `total` say how many."""

    def __init__(self, message: str, *, needed: int, free: int, total: int, hint: str | None = None) -> None:
        self.needed, self.free, self.total = needed, free, total
        super().__init__(message, hint=hint, needed=needed, free=free, total=total)


@dataclass(frozen=True)
class CacheSpec:
    """One cache input: its batch-1 shape (any size along `axis`), its sequence axis, its dtype."""

    shape: tuple[int, ...]
    axis: int
    dtype: np.dtype


class KVPool:
    def __init__(self, specs: Mapping[str, CacheSpec], *, num_blocks: int, block_size: int, int8: bool = False,
                 sram_blocks: int = 0) -> None:
        if num_blocks < 1 or block_size < 1:
            raise AviatorError(f"a KV pool needs at least one block of at least one token "
                               f"(got {num_blocks} blocks of {block_size})", hint="--kv-blocks and --block-size")
        self.specs = dict(specs)
        self.num_blocks, self.block_size, self.int8 = num_blocks, block_size, int8
        # The plan keeps the pool's first blocks in SRAM (`MemoryFigures.kv_sram_positions`); the
        # lowest free block going first, running sequences take those before the ones in LPDDR.
        self.sram_blocks = min(num_blocks, max(0, sram_blocks))
        self.arrays: dict[str, tuple[np.ndarray, ...]] = {}
        for name, spec in self.specs.items():
            if spec.axis < 1:
                raise AviatorError(f"cache input '{name}' has its sequence on axis {spec.axis}: axis 0 is the batch")
            shape = list(spec.shape)
            shape[0], shape[spec.axis] = num_blocks, block_size
            if int8:
                self.arrays[name] = (np.zeros(shape, np.int8), np.zeros([*shape[:-1], 1], np.float16))
            else:
                self.arrays[name] = (np.zeros(shape, spec.dtype),)
        self.refs = np.zeros(num_blocks, np.int64)
        self._free = list(range(num_blocks))  # a heap: the lowest free block first (deterministic)
        # A server prefills an urgent request while a decode step runs in another thread: both take
        # and give back blocks (never the same ones, so the contents need no lock).
        self._lock = threading.Lock()

    # -- counting --------------------------------------------------------------------------

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def used_sram_blocks(self) -> int:
        """Blocks in use among those the plan keeps in SRAM."""
        return int(np.count_nonzero(self.refs[:self.sram_blocks]))

    @property
    def block_bytes(self) -> int:
        """Bytes one block holds, over every cache input."""
        return sum(a[0].nbytes for parts in self.arrays.values() for a in parts)

    def blocks_for(self, positions: int) -> int:
        return math.ceil(positions / self.block_size)

    # -- ownership -------------------------------------------------------------------------

    def reserve(self, table: list[int], start: int, stop: int) -> None:
        """Make `table` cover positions [0, stop) with the blocks holding [start, stop) its own:
        new blocks appended, shared ones among them copied (copy-on-write). All or nothing."""
        with self._lock:
            self._reserve(table, start, stop)

    def _reserve(self, table: list[int], start: int, stop: int) -> None:
        first, last = start // self.block_size, self.blocks_for(stop)
        shared = [j for j in range(first, min(last, len(table))) if self.refs[table[j]] > 1]
        needed = max(0, last - len(table)) + len(shared)
        if needed > len(self._free):
            raise OutOfBlocks(f"the KV cache needs {needed} more block(s) of {self.block_size} tokens but "
                              f"{len(self._free)} of {self.num_blocks} are free",
                              needed=needed, free=len(self._free), total=self.num_blocks,
                              hint="serve with more --kv-blocks, or fewer --max-num-seqs")
        for j in shared:
            block = self._take()
            for parts in self.arrays.values():
                for array in parts:
                    array[block] = array[table[j]]
            self.refs[table[j]] -= 1
            table[j] = block
        while len(table) < last:
            table.append(self._take())

    def release(self, table: list[int], keep: int = 0) -> None:
        """Give back the blocks of `table` past its first `keep` positions."""
        kept = self.blocks_for(keep)
        with self._lock:
            for block in table[kept:]:
                self.refs[block] -= 1
                if self.refs[block] == 0:
                    heapq.heappush(self._free, block)
            del table[kept:]

    def share(self, blocks: Sequence[int]) -> list[int]:
        """One more holder of `blocks` (each must be held already): a copy of the list to own."""
        with self._lock:
            for block in blocks:
                assert self.refs[block] > 0, f"block {block} is free"
                self.refs[block] += 1
        return list(blocks)

    def _take(self) -> int:
        block = heapq.heappop(self._free)
        self.refs[block] = 1
        return block

    # -- contents --------------------------------------------------------------------------

    def write(self, table: Sequence[int], name: str, start: int, values: np.ndarray) -> None:
        """Positions `start` .. of cache input `name` from `values` (batch-1, positions along the
        input's axis), into blocks `reserve` gave the table."""
        spec, parts = self.specs[name], self.arrays[name]
        axis, size = spec.axis, self.block_size
        sources = quantize_kv(values) if self.int8 else (values,)
        stop = start + values.shape[axis]
        for j in range(start // size, self.blocks_for(stop)):
            lo, hi = max(start, j * size), min(stop, (j + 1) * size)
            into: tuple[int | slice, ...] = (table[j], *(slice(None),) * (axis - 1), slice(lo - j * size, hi - j * size))
            came: tuple[int | slice, ...] = (0, *(slice(None),) * (axis - 1), slice(lo - start, hi - start))
            for array, source in zip(parts, sources):
                array[into] = source[came]

    def read(self, table: Sequence[int], name: str, stop: int) -> np.ndarray:
        """Positions [0, stop) of cache input `name`: a batch-1 array of the graph's dtype."""
        spec = self.specs[name]
        blocks = np.asarray(table[:self.blocks_for(stop)], dtype=np.int64)
        gathered = [self._joined(np.take(array, blocks, axis=0), spec.axis, stop) for array in self.arrays[name]]
        if self.int8:
            return dequantize_kv(*gathered).astype(spec.dtype, copy=False)
        return gathered[0]

    def _joined(self, blocks: np.ndarray, axis: int, stop: int) -> np.ndarray:
        """Blocks [n, ..., block_size at `axis`, ...] as one batch-1 run of their first `stop` positions."""
        moved = np.moveaxis(blocks, 0, axis - 1)  # [..., n, block_size, ...]
        shape = [*moved.shape[:axis - 1], moved.shape[axis - 1] * moved.shape[axis], *moved.shape[axis + 1:]]
        joined = moved.reshape(shape)[None]
        return joined[(slice(None),) * axis + (slice(0, stop),)]
