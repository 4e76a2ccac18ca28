"""`Precedence`: one thread's step has a session's device before the steps in flight on others.

    with session.precedence.first():        # in the thread that must not wait
        logits = session.prefill(slot, ids)

The backends call `checkpoint()` between instructions: it returns at once unless another thread
holds precedence, and then waits until that thread is done. The serving engine prefills an
interactive arrival this way while a background decode step is in flight: on the target the
step would end within a millisecond and the prefill would follow it; on the simulator the step
takes hundreds, so it pauses at its next instruction instead of sharing the CPU with the prefill.
Nothing is held across a checkpoint, so a paused step cannot block the one that goes first.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager


class Precedence:
    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._holders = Counter[int]()  # thread id -> nesting depth
        self.held = False  # read without the lock on the hot path: a stale False only delays a pause

    @contextmanager
    def first(self) -> Iterator[None]:
        """While inside, steps of this session running on other threads pause at their next instruction."""
        me = threading.get_ident()
        with self._changed:
            self._holders[me] += 1
            self.held = True
        try:
            yield
        finally:
            with self._changed:
                self._holders[me] -= 1
                if not self._holders[me]:
                    del self._holders[me]
                self.held = bool(self._holders)
                self._changed.notify_all()

    def checkpoint(self) -> None:
        """Wait while another thread holds precedence (a no-op when none does)."""
        if not self.held:
            return
        me = threading.get_ident()
        with self._changed:
            while self._holders and me not in self._holders:
                self._changed.wait()
