"""Faults under torchrun: a killed or hung rank ends the run within a bound, naming that rank, leaving no
process behind; with --max-restarts the run restarts and resumes from its checkpoints, and the losses
are exactly those of an uninterrupted run (10 kills in one run).

Faults are injected from outside, as they happen: SIGKILL (a crash, the OOM killer) or SIGSTOP (a hung
process that holds its sockets open) sent to one worker, found by a tag in its environment.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
import uuid
from pathlib import Path

import pytest

from planner.plan import Plan
from runners.launch import RunFailed, launch
from tests.distributed.harness import tiny_config

TORCHRUN_GRACE_S = 30  # torchrun's agent: SIGTERM, then SIGKILL after this many seconds


def _worker_pids(tag: str) -> dict[int, int]:
    """rank -> pid of the live training workers whose environment carries `tag`."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = (entry / "environ").read_bytes().split(b"\0")
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if f"PLANNER_TEST_TAG={tag}".encode() in env and b"runners.train" in cmdline and b"torch.distributed.run" not in cmdline:
            for item in env:
                if item.startswith(b"RANK="):
                    found[int(item[5:])] = int(entry.name)
    return found


def _tagged_pids(tag: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if f"PLANNER_TEST_TAG={tag}".encode() in (entry / "environ").read_bytes().split(b"\0"):
                    status = (entry / "status").read_text()
                    if "State:\tZ" not in status:
                        pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def _config(steps: int, **changes):
    cfg = tiny_config(Plan(dp=2, param_shard=2, grad_shard=2, optim_shard=2, micro_batch=2, num_micro_batches=2),
                      steps=steps)
    return dataclasses.replace(cfg, **changes)


def _launch(cfg, *, tag: str, on_step=None, max_restarts: int = 0):
    return launch(cfg, nproc=2, on_step=on_step, max_restarts=max_restarts,
                  env={"PLANNER_TEST_TAG": tag, "OMP_NUM_THREADS": "1"})


class _Injector:
    """Calls `fault(rank 1's pid)` when the run reports step `at_step` (the launcher's step callback)."""

    def __init__(self, tag: str, *, at_step: int, sig: int) -> None:
        self.tag, self.at_step, self.sig = tag, at_step, sig
        self.fired_at: float | None = None

    def __call__(self, record: dict) -> None:
        if self.fired_at is None and record["step"] >= self.at_step:
            pids = _worker_pids(self.tag)
            os.kill(pids[1], self.sig)
            self.fired_at = time.monotonic()


def test_killed_rank_is_named_and_nothing_is_left():
    tag = uuid.uuid4().hex
    inject = _Injector(tag, at_step=1, sig=signal.SIGKILL)
    with pytest.raises(RunFailed, match=r"rank 1\b") as info:
        _launch(_config(500), tag=tag, on_step=inject)
    assert inject.fired_at is not None
    elapsed_s = time.monotonic() - inject.fired_at
    assert elapsed_s < TORCHRUN_GRACE_S, f"the run took {elapsed_s:.0f} s to stop after rank 1 died"
    assert "killed by signal 9" in str(info.value) or "stopped responding" in str(info.value)
    assert _tagged_pids(tag) == []


def test_hung_rank_times_out_and_is_named():
    """A stopped process keeps its sockets: only the collective timeout can end the run."""
    tag = uuid.uuid4().hex
    timeout_s = 10.0
    inject = _Injector(tag, at_step=1, sig=signal.SIGSTOP)
    with pytest.raises(RunFailed) as info:
        _launch(_config(500, timeout_s=timeout_s), tag=tag, on_step=inject)
    elapsed_s = time.monotonic() - inject.fired_at
    message = str(info.value)
    assert "rank 1 (last seen at step" in message and "stopped responding" in message, message
    # The bound: the timeout, the 3 s in which failing ranks compare notes (runners.faults.suspects),
    # torchrun's grace before it SIGKILLs the stopped process, and slack for a loaded 2-core machine.
    bound_s = timeout_s + 3 + TORCHRUN_GRACE_S + 30
    assert timeout_s <= elapsed_s < bound_s, f"stopped {elapsed_s:.0f} s after the hang (bound {bound_s:.0f} s)"
    assert _tagged_pids(tag) == []


class _RepeatedKiller:
    """Kill rank 1 at the first step each incarnation reports, `num_kills` times; record every step seen."""

    def __init__(self, tag: str, *, num_kills: int) -> None:
        self.tag, self.num_kills = tag, num_kills
        self.records: list[dict] = []
        self.killed_pids: set[int] = set()

    def __call__(self, record: dict) -> None:
        self.records.append(record)
        if len(self.killed_pids) >= self.num_kills:
            return
        pid = _worker_pids(self.tag).get(1)
        if pid is not None and pid not in self.killed_pids:
            self.killed_pids.add(pid)
            os.kill(pid, signal.SIGKILL)


def test_ten_kills_restart_and_resume_with_identical_losses(tmp_path):
    """torchrun --max-restarts: after each kill every worker restarts and resumes from `latest`; every
    step reported (before and after each kill) has exactly the uninterrupted run's loss."""
    steps, num_kills = 12, 10
    tag = uuid.uuid4().hex
    reference = _launch(_config(steps), tag=uuid.uuid4().hex)
    ref_losses = {s["step"]: s["loss"] for s in reference["steps"]}
    killer = _RepeatedKiller(tag, num_kills=num_kills)
    metrics = _launch(_config(steps, checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=1), tag=tag,
                      on_step=killer, max_restarts=num_kills)
    assert len(killer.killed_pids) == num_kills
    seen = [r["step"] for r in killer.records]
    assert sorted(set(seen)) == list(range(steps)), seen
    for record in killer.records:
        assert record["loss"] == ref_losses[record["step"]], (record, ref_losses[record["step"]])
    final = {s["step"]: s["loss"] for s in metrics["steps"]}
    assert all(final[k] == ref_losses[k] for k in final)
    assert _tagged_pids(tag) == []
