"""Ctrl-C around the moments a launcher starts a process.

A KeyboardInterrupt raised inside subprocess.Popen, after the fork and before Popen returns, leaves a
started child that its caller never got to record, so nothing stops it: seen as a collective worker left
running after `planner profile` returned from Ctrl-C (1 in 8 tries with SIGINT sent as the first worker
appeared; 0 in 20 with the start inside `interrupt_deferred`).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def interrupt_deferred() -> Iterator[None]:
    """Hold a Ctrl-C (SIGINT) that arrives inside the block until the block ends, then raise it as the
    handler in place would have. Only the main thread runs Python's signal handlers; elsewhere the block
    runs as is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if caught and callable(previous):
            previous(signal.SIGINT, None)
        elif caught and previous == signal.SIG_DFL:
            raise KeyboardInterrupt
