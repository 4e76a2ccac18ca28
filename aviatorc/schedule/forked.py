"""Independent simulations at once on the machine's cores.

The simulator is plain Python and a plan is large, so work is handed to forked workers, which
inherit the function and everything it closes over: only the items and results are pickled.
Each item's result is the same deterministic computation as run alone, so the outcome does not
depend on how many workers there are; without `fork` (or with one core) the items run in turn.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any

MAX_WORKERS = 4
_WORK: Callable[[Any], Any] | None = None


def forked_map(work: Callable[[Any], Any], items: Sequence[Any]) -> list[Any]:
    """`[work(item) for item in items]`, on up to MAX_WORKERS forked workers."""
    workers = min(len(items), os.cpu_count() or 1, MAX_WORKERS)
    if workers < 2 or "fork" not in multiprocessing.get_all_start_methods():
        return [work(item) for item in items]
    global _WORK
    _WORK = work  # the forked workers inherit it: nothing large is pickled
    try:
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
            return list(pool.map(_run, items))
    finally:
        _WORK = None


def _run(item: Any) -> Any:
    assert _WORK is not None
    return _WORK(item)
