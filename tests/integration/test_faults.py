"""Faults under the launcher (its own local processes, or torchrun with --max-restarts): a killed or hung
rank ends the run within a bound, naming that rank, leaving no process behind; with --max-restarts the
run restarts and resumes from its checkpoints, and the losses are exactly those of an uninterrupted run
(10 kills in one run).

Faults are injected from outside, as they happen: SIGKILL (a crash, the OOM killer) or SIGSTOP (a hung
process that holds its sockets open) sent to one worker, found by a tag in its environment.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import time
import uuid
from pathlib import Path

import pytest

from specs.plan import Plan
from runners.launch import EVENT_PREFIX, RunFailed, Where, launch
from tests.distributed.harness import run_plans, tiny_config

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
    return launch(cfg, where=Where(nproc=2, max_restarts=max_restarts), on_step=on_step,
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
    # The uninterrupted run on the distributed tests' gloo processes (forks of a server that imported torch
    # once): runners.train.train on the same config, bit for bit the launcher's losses, 6 s sooner here.
    [(reference, _)] = run_plans([_config(steps)])
    ref_losses = {s.step: s.loss for s in reference.steps}
    killer = _RepeatedKiller(tag, num_kills=num_kills)
    metrics = _launch(_config(steps, checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=1), tag=tag,
                      on_step=killer, max_restarts=num_kills)
    assert len(killer.killed_pids) == num_kills
    seen = [r["step"] for r in killer.records]
    assert sorted(set(seen)) == list(range(steps)), seen
    for record in killer.records:
        assert record["loss"] == ref_losses[record["step"]], (record, ref_losses[record["step"]])
    final = {s.step: s.loss for s in metrics.steps}
    assert all(final[k] == ref_losses[k] for k in final)
    assert _tagged_pids(tag) == []


# --- a whole node of the emulated cluster dies or drops off the network ---------------------------------------
def _netns_skip_reason() -> str | None:
    from tests.integration.netns_support import netns_skip_reason

    return netns_skip_reason("plfault")


@pytest.mark.skipif(_netns_skip_reason() is not None, reason=str(_netns_skip_reason()))
@pytest.mark.parametrize("how", ["killed", "cut-off"])
def test_whole_node_lost_ends_the_other_node_within_the_bound(how, tmp_path, monkeypatch):
    """Two emulated nodes (network namespaces), one rank each, each with its own torchrun and no common
    launcher, as on a real cluster. Node 1 is SIGKILLed whole (agent and worker: its sockets close) or
    cut off (every process frozen and its link down: nothing closes, only the timeout can tell). Node 0
    must exit by itself within the bound, naming rank 1, with nothing left in its namespace."""
    import subprocess

    from specs.jsonio import write_json_atomic
    from runners import netns_cluster as nc

    monkeypatch.setenv("PLANNER_CLUSTER_STATE_DIR", str(tmp_path))
    prefix = "plfault"
    nc.down(prefix=prefix)
    state = nc.up(num_nodes=2, procs_per_node=1, inter_node_bandwidth=None, inter_node_latency=None, prefix=prefix)
    timeout_s = 15.0
    # The worker protocol of runners.launch by hand: DIR/spec.json in, DIR/errors/rank<N>.json out.
    errors = tmp_path / "errors"
    errors.mkdir()
    write_json_atomic(tmp_path / "spec.json", _config(500, timeout_s=timeout_s, ranks_per_node=1).to_dict())
    procs = []
    try:
        for node in range(2):
            argv = nc.exec_argv(state, node, nc.torchrun_argv(state, node, ["-m", "runners.train", "--work-dir",
                                                                            str(tmp_path)]))
            procs.append(subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                          start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"}))
        for line in procs[0].stdout:  # wait until rank 0 reports step 1
            if line.startswith(EVENT_PREFIX) and json.loads(line[len(EVENT_PREFIX):]).get("step", -1) >= 1:
                break
        victims = nc.namespace_pids(state.namespace(1))
        if how == "killed":
            for pid in victims:
                os.kill(pid, signal.SIGKILL)
        else:
            for pid in victims:
                os.kill(pid, signal.SIGSTOP)
            subprocess.run(["ip", "-n", state.namespace(1), "link", "set", nc.NODE_IFNAME, "down"], check=True)
        lost_at = time.monotonic()
        procs[0].communicate(timeout=timeout_s + 3 + TORCHRUN_GRACE_S + 60)
        elapsed_s = time.monotonic() - lost_at
        assert procs[0].returncode != 0
        report = json.loads((errors / "rank0.json").read_text())
        assert "rank 1 (last seen at step" in report["error"], report
        bound_s = (TORCHRUN_GRACE_S if how == "killed" else timeout_s + 3 + TORCHRUN_GRACE_S) + 30
        assert elapsed_s < bound_s, f"node 0 took {elapsed_s:.0f} s to stop after node 1 was {how} (bound {bound_s:.0f} s)"
        assert nc.namespace_pids(state.namespace(0)) == []
    finally:
        for proc in procs:
            if proc.poll() is None:
                nc.kill_process_tree(proc.pid)
        for pid in nc.namespace_pids(state.namespace(1)) if nc.list_namespaces(prefix) else []:
            os.kill(pid, signal.SIGKILL)
        nc.down(prefix=prefix)


def test_cli_resume_under_another_plan_continues_the_losses(tmp_path, monkeypatch):
    """`planner run --checkpoint-dir D` stopped after 3 steps, then `--resume` under tp2 for the rest: the
    losses are those of one uninterrupted ZeRO-3 run (fp32 on CPU, 1e-4)."""
    import sys

    from planner.cli import main
    from runners.config import RunMetrics

    def run(*flags: str) -> RunMetrics:
        out = tmp_path / f"metrics{len(list(tmp_path.glob('metrics*')))}.json"
        monkeypatch.setattr(sys, "argv", ["planner", "run", "--nproc", "2", "--global-batch", "8", "--seq-len", "32",
                                          "--micro-batch", "2", "--seed", "7", "--format", "json",
                                          "--metrics-out", str(out), *flags])
        with pytest.raises(SystemExit) as info:
            main()
        assert info.value.code == 0
        return RunMetrics.from_dict(json.loads(out.read_text()))

    ckpt = str(tmp_path / "ckpt")
    whole = run("--zero", "3", "--steps", "6")
    first = run("--zero", "3", "--steps", "3", "--checkpoint-dir", ckpt)
    rest = run("--tp", "2", "--steps", "6", "--checkpoint-dir", ckpt, "--resume")
    assert [s.step for s in rest.steps] == [3, 4, 5]
    losses = first.losses + rest.losses
    expected = whole.losses
    assert max(abs(a - b) for a, b in zip(losses, expected)) <= 1e-4, (losses, expected)


def test_only_communication_failures_consult_the_progress_board():
    """A rank's own bug names that rank; only a broken or timed-out collective blames the silent ranks."""
    from runners.faults import is_communication_failure

    assert is_communication_failure(RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error [10.77.0.2]:1234: "
                                                 "Connection reset by peer"))
    assert is_communication_failure(RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting "
                                                 "10000ms for recv operation to complete"))
    assert not is_communication_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x8 and 16x8)"))
    assert not is_communication_failure(ZeroDivisionError("float division by zero"))
