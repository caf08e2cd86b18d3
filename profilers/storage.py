"""Checkpoint storage: the sustained write bandwidth of this node (files written and fsynced).

    python -c "from profilers.storage import measure_storage_write; print(measure_storage_write(quick=True))"

It prices a checkpoint write (cost_models/checkpoint.py), so it is measured the way checkpoints are
written: whole files in large chunks, each fsynced before the clock stops (DCP with sync_files=True).
The folder is the temp directory's file system unless PLANNER_STORAGE_PROBE_DIR names the one that
will hold the checkpoints.
"""

from __future__ import annotations

import os
import tempfile
import time

CHUNK_BYTES = 8 << 20


def measure_storage_write(*, quick: bool, folder: str | None = None) -> float:
    """Bytes per second written and fsynced to `folder`; the best of two files (64 MiB each, quick; else
    256 MiB), so a cache flush of earlier writes does not count against it."""
    folder = folder or os.environ.get("PLANNER_STORAGE_PROBE_DIR") or tempfile.gettempdir()
    total_bytes = (64 if quick else 256) << 20
    chunk = os.urandom(CHUNK_BYTES)  # random: a compressing file system would flatter zeros
    best_s = float("inf")
    for _ in range(2):
        with tempfile.NamedTemporaryFile(dir=folder, prefix="planner-storage-probe-") as f:
            start = time.perf_counter()
            for _ in range(total_bytes // CHUNK_BYTES):
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
            best_s = min(best_s, time.perf_counter() - start)
    return total_bytes / best_s
