"""Run a call that may crash the process (a C++ assertion in onnx) in a forked child.

onnx shape inference is native code: on some malformed models it aborts the process
(SIGABRT from an assertion) instead of raising. The importer only takes hints from it, so
it runs in a child: a crash or a timeout there costs the hints, not the import.
"""

from __future__ import annotations

import os
import selectors
import signal
import time
from collections.abc import Callable

INFERENCE_TIMEOUT_S = 60.0


def run_in_child(fn: Callable[[], bytes], timeout_s: float = INFERENCE_TIMEOUT_S) -> bytes | None:
    """`fn()` computed in a forked child; None when the child fails, crashes or runs past `timeout_s`.

    Without fork (Windows) `fn` runs in this process."""
    if not hasattr(os, "fork"):
        return fn()
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: compute, write, and leave without running any cleanup of the parent's
        code = 1
        try:
            os.close(read_fd)
            quiet = os.open(os.devnull, os.O_WRONLY)
            os.dup2(quiet, 2)  # an assertion's text is not for the user: the parent goes on without hints
            data = fn()
            view = memoryview(data)
            while view:
                view = view[os.write(write_fd, view):]
            code = 0
        finally:
            os._exit(code)
    os.close(write_fd)
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout_s
    timed_out = False
    with selectors.DefaultSelector() as selector:
        selector.register(read_fd, selectors.EVENT_READ)
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not selector.select(left):
                timed_out = True
                break
            chunk = os.read(read_fd, 1 << 20)
            if not chunk:
                break
            chunks.append(chunk)
    os.close(read_fd)
    if timed_out:
        os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    if timed_out or os.waitstatus_to_exitcode(status) != 0:
        return None
    return b"".join(chunks)
