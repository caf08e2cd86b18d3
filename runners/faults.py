"""Failure handling for training runs: a collective timeout derived from the plan, and naming the rank
that stopped.

A rank that dies closes its sockets, so its peers' next collective fails at once (and torchrun's agent
stops the node's other workers). A rank that hangs (a stuck kernel, a stopped process, a node cut off
the network) closes nothing: its peers wait inside a collective until the process-group timeout, which
gloo honours on every group (runners/mesh.py gives the sub-groups the same timeout). Then every waiting
rank raises, and to say *which* rank hung each rank posts its progress (the step it is on) to the c10d
store as it goes; the failing ranks read the board and name the ranks that fell behind.
"""

from __future__ import annotations

import datetime
import logging
import os
import re
import signal
import sys
import time

import torch.distributed as dist

log = logging.getLogger(__name__)

MIN_TIMEOUT_S = 60.0
# A healthy rank waits for a peer at most about one step (a pipeline's warm-up and drain are shorter);
# the first step also allocates and warms up, so allow many steps.
STEP_TIME_FACTOR = 20.0
# Checkpoint writes: ranks wait in DCP's final collective while the slowest rank writes its share.
CHECKPOINT_WRITE_BYTES_PER_S = 100e6
_KEY = "planner/progress/{rank}"
_FAILED = "planner/failed/{rank}"


def derive_timeout_s(*, step_time_s: float, checkpoint_bytes_per_rank: float = 0.0) -> float:
    """The collective timeout: the longest a healthy rank can wait for a peer, with a wide margin.

    max(60 s, 20 x predicted step time + 3 x the time to write one rank's checkpoint share at 100 MB/s).
    """
    return max(MIN_TIMEOUT_S, STEP_TIME_FACTOR * step_time_s + 3.0 * checkpoint_bytes_per_rank / CHECKPOINT_WRITE_BYTES_PER_S)


def checkpoint_bytes_per_rank(*, num_params: int, world_size: int) -> float:
    """fp32 master weights and two Adam moments of every parameter, spread over the ranks."""
    return 12.0 * num_params / max(1, world_size)


def store_attempt_prefix() -> str:
    """The key prefix that keeps one torchrun attempt's store keys apart from an earlier attempt's.

    A restart against torchrun's agent store reuses that store, so its keys are namespaced by the restart
    count. An elastic run (runners/elastic.py) has no agent store: rank 0 of every attempt hosts a fresh
    one, so it needs no prefix, and must not have one, since the count is per agent and a node that joins
    later counts from 0 while the others do not."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return ""
    return "planner/attempt" + os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") + "/"


def _key(template: str, rank: int) -> str:
    return store_attempt_prefix() + template.format(rank=rank)


def _store():
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, AttributeError, ValueError):
        return None


def post_progress(step: int) -> None:
    """Record that this rank started `step` (one small store write per step)."""
    store = _store()
    if store is not None:
        try:
            store.set(_key(_KEY, dist.get_rank()), str(step))
        except Exception:  # the store's host is gone: the collectives will fail and say so
            pass


def _board(store, *, timeout_s: float) -> tuple[dict[int, int], set[int]]:
    """Each rank's last posted step (-1: none) and the ranks that reported a failure."""
    store.set_timeout(datetime.timedelta(seconds=timeout_s))
    progress, failed = {}, set()
    for rank in range(dist.get_world_size()):
        key = _key(_KEY, rank)
        progress[rank] = int(store.get(key)) if store.check([key]) else -1
        if store.check([_key(_FAILED, rank)]):
            failed.add(rank)
    return progress, failed


def suspects(*, grace_s: float = 3.0) -> tuple[list[int], dict[int, int]]:
    """After this rank's collective failed: the ranks that neither failed the same way within `grace_s`
    (their peers time out together) nor got further than the others; and each rank's posted step."""
    store = _store()
    if store is None:
        return [], {}
    try:
        store.set(_key(_FAILED, dist.get_rank()), "1")
        deadline = time.monotonic() + grace_s
        while True:
            progress, failed = _board(store, timeout_s=grace_s)
            if len(failed) == len(progress) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    except Exception as exc:  # the store died with rank 0's node
        log.debug("cannot read the progress board: %s", exc)
        return [], {}
    silent = {r: s for r, s in progress.items() if r not in failed}
    if not silent:
        return [], progress
    low = min(silent.values())
    return sorted(r for r, s in silent.items() if s == low), progress


_COMM_FAILURE = re.compile(r"gloo|nccl|timed out|timeout|connection|socket|peer|broken pipe", re.I)


def is_communication_failure(exc: BaseException) -> bool:
    """A collective that timed out or lost its peer (not a bug or bad input on this rank)."""
    return isinstance(exc, getattr(dist, "DistError", ())) or (
        isinstance(exc, RuntimeError) and bool(_COMM_FAILURE.search(str(exc))))


def describe_failure(exc: BaseException) -> str:
    """The exception's first line, led by the ranks that stopped (hung or died) when a collective timed
    out or broke."""
    message = f"{type(exc).__name__}: {exc}".strip().splitlines()[0]
    if not dist.is_initialized() or not is_communication_failure(exc):
        return message  # this rank's own error: it is the failed rank, the others did nothing wrong
    stopped, progress = suspects()
    if stopped:
        names = ", ".join(f"rank {r} (last seen at step {progress[r]})" if progress[r] >= 0 else f"rank {r} (never started)"
                          for r in stopped)
        return f"{names} stopped responding; rank {dist.get_rank()} saw: {message}"
    return message


# --- process start ------------------------------------------------------------------------------------------
def nccl_failure_env() -> dict[str, str]:
    """NCCL settings under which a timed-out collective raises in the rank's own thread instead of killing
    the process: torch's watchdog by default (TORCH_NCCL_ASYNC_ERROR_HANDLING=3) aborts the process on a
    timeout, before `describe_failure` can name the rank that hung; 2 (clean up only) aborts the
    communicators, so the blocked kernels end and the next wait raises. A value the user set is kept."""
    return {"TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")}


def init_distributed(backend: str, *, timeout_s: float) -> None:
    """init_process_group on a store namespaced by torchrun's restart attempt.

    torchrun restarts workers against the same agent store, and the default process group's keys
    (each rank's gloo address) survive from the failed attempt: the new ranks read the dead ranks'
    addresses and gloo's connectFullMesh hangs until its connect timeout (seen with torch 2.13). A prefix
    per attempt gives every attempt fresh keys (`store_attempt_prefix`). Without torchrun's agent store,
    rank 0 hosts a fresh store.
    """
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    timeout = datetime.timedelta(seconds=timeout_s)
    os.environ.update(nccl_failure_env())
    if "MASTER_ADDR" not in os.environ:
        dist.init_process_group(backend, timeout=timeout)
        return
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=not agent_store and rank == 0, timeout=timeout)
    prefix = store_attempt_prefix()
    dist.init_process_group(backend, store=dist.PrefixStore(prefix, store) if prefix else store, rank=rank,
                            world_size=world, timeout=timeout)


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this worker when its parent (torchrun's agent) dies, however it dies: the
    agent starts workers in their own sessions, so killing the launcher's process group does not reach
    them, and an agent killed with SIGKILL cannot stop them itself."""
    if sys.platform != "linux":
        return
    import ctypes

    PR_SET_PDEATHSIG = 1
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the parent died before the request took effect
        os.kill(os.getpid(), signal.SIGKILL)
