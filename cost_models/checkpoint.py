"""The price of a checkpoint, and the checkpoint interval that loses least time to failures.

A checkpoint (runners/checkpoint.py) holds each parameter's fp32 master value and its two Adam moments
(12 bytes per parameter) once over all ranks (replicas write nothing), and each node writes its ranks'
share at its storage write bandwidth, all nodes at once:

    write_s = 12 x parameters / (nodes x storage write bytes per second per node)

(Hardware.storage_write_bytes_per_s: measured by `planner profile` on this host; datasheet presets and
older profiles carry none, and take DEFAULT_STORAGE_WRITE_BYTES_PER_S.)

Under failures at a mean time between failures M (of the whole job), checkpointing every tau seconds of
work at a cost C each: Young (1974) tau = sqrt(2 C M); Daly (2006), to higher order,
tau = sqrt(2 C M) (1 + sqrt(C / (2 M)) / 3 + C / (18 M)) - C for C < 2 M, else M. Expected goodput (the
share of wall time that is training kept): each cycle of tau + C does tau of work, and each failure
loses on average half a cycle plus the restart R, so goodput = tau / (tau + C) x (1 - (R + (tau + C) / 2) / M),
at least 0 (a first-order model: failures during a restart are not counted).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Bytes a checkpoint stores per parameter: fp32 master weight, Adam's exp_avg and exp_avg_sq.
CHECKPOINT_BYTES_PER_PARAM = 12
# A node's checkpoint write bandwidth where the hardware has no measured one: 1 GB/s, a local NVMe
# drive's sustained write or a parallel file system's per-client share.
DEFAULT_STORAGE_WRITE_BYTES_PER_S = 1e9
# Loss to first new step of an elastic restart, where none is given: this project's measured bound on
# the emulated cluster (benchmarks/elastic.py), rounded up.
DEFAULT_RESTART_S = 30.0


def checkpoint_write_s(*, num_params: int, num_nodes: int, storage_write_bytes_per_s: float) -> float:
    """Seconds to write one checkpoint of `num_params` parameters from `num_nodes` nodes at once."""
    bandwidth = storage_write_bytes_per_s if storage_write_bytes_per_s > 0 else DEFAULT_STORAGE_WRITE_BYTES_PER_S
    return CHECKPOINT_BYTES_PER_PARAM * num_params / (max(1, num_nodes) * bandwidth)


def young_interval_s(*, write_s: float, mtbf_s: float) -> float:
    """Young's first-order optimum: seconds of work between checkpoints."""
    _check(write_s=write_s, mtbf_s=mtbf_s)
    return math.sqrt(2.0 * write_s * mtbf_s)


def daly_interval_s(*, write_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimum (Young's for C << M; M itself once a checkpoint costs 2 M or more)."""
    _check(write_s=write_s, mtbf_s=mtbf_s)
    if write_s >= 2.0 * mtbf_s:
        return mtbf_s
    ratio = write_s / (2.0 * mtbf_s)
    return math.sqrt(2.0 * write_s * mtbf_s) * (1.0 + math.sqrt(ratio) / 3.0 + ratio / 9.0) - write_s


def expected_goodput(*, interval_s: float, write_s: float, mtbf_s: float, restart_s: float) -> float:
    """The share of wall time spent on training that is kept, checkpointing every `interval_s` of work."""
    _check(write_s=write_s, mtbf_s=mtbf_s)
    if interval_s <= 0 or restart_s < 0:
        raise ValueError(f"interval_s must be positive and restart_s non-negative, got {interval_s}, {restart_s}")
    cycle_s = interval_s + write_s
    return max(0.0, interval_s / cycle_s * (1.0 - (restart_s + cycle_s / 2.0) / mtbf_s))


def _check(*, write_s: float, mtbf_s: float) -> None:
    if not write_s >= 0 or not 0 < mtbf_s < math.inf:
        raise ValueError(f"a checkpoint's cost must be >= 0 and the MTBF positive and finite, got {write_s}, {mtbf_s}")


@dataclass(frozen=True)
class CheckpointCadence:
    """The checkpoint interval for a plan under a failure rate, and what it keeps."""

    mtbf_s: float
    write_s: float
    restart_s: float
    step_time_s: float
    interval_s: float  # Daly's optimum, in seconds of work
    every_steps: int  # the interval in whole steps (at least 1)
    goodput: float  # expected, at `every_steps`

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def cadence(*, step_time_s: float, write_s: float, mtbf_s: float, restart_s: float = DEFAULT_RESTART_S) -> CheckpointCadence:
    """Daly's interval rounded to whole steps of `step_time_s`, and the expected goodput there."""
    interval_s = daly_interval_s(write_s=write_s, mtbf_s=mtbf_s)
    every = max(1, round(interval_s / step_time_s)) if step_time_s > 0 else 1
    goodput = expected_goodput(interval_s=every * step_time_s if step_time_s > 0 else interval_s, write_s=write_s,
                               mtbf_s=mtbf_s, restart_s=restart_s)
    return CheckpointCadence(mtbf_s=mtbf_s, write_s=write_s, restart_s=restart_s, step_time_s=step_time_s,
                             interval_s=interval_s, every_steps=every, goodput=goodput)


def plan_cadence(*, model, cluster, step_time_s: float, mtbf_s: float,
                 restart_s: float = DEFAULT_RESTART_S) -> CheckpointCadence:
    """The cadence for training `model` on `cluster` (specs types) at a predicted `step_time_s`."""
    write_s = checkpoint_write_s(num_params=model.num_params(), num_nodes=cluster.num_nodes,
                                 storage_write_bytes_per_s=cluster.hardware.storage_write_bytes_per_s)
    return cadence(step_time_s=step_time_s, write_s=write_s, mtbf_s=mtbf_s, restart_s=restart_s)
