"""Commshift (Hosoki et al., CCGrid 2025): every gradient reduction of a chunk's last micro-batch (its
reduce-scatter buckets and the boundary all-reduce) waits for `start(chunk)`, which the pipeline calls
after the chunk's last input-gradient send: once that send is done (on gloo, acknowledged by the
receiver) where the chunk's last backward is the rank's last action, so the reduction never shares the
link with it; right after issuing it otherwise (runners/pipeline.py, Step.after_send)."""

from __future__ import annotations


class DeferredSync:
    """The reductions held back per local chunk until the pipeline releases the chunk."""

    def __init__(self, num_chunks: int, *, enabled: bool) -> None:
        self.enabled = enabled
        self.deferred: list[list] = [[] for _ in range(num_chunks)]  # per chunk: last micro-batch's buckets
        self.released: set[int] = set()

    def hold(self, chunk: int, bucket) -> None:
        self.deferred[chunk].append(bucket)

    def release(self, chunk: int) -> list:
        """The held buckets of local chunk `chunk` in backward order; the chunk counts as released until
        the next step."""
        self.released.add(chunk)
        held, self.deferred[chunk] = self.deferred[chunk], []
        return held

    def new_step(self) -> None:
        self.released.clear()
