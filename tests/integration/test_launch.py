"""The launcher's own local processes (runners.launch.direct_launch): the environment torchrun would give
each worker, events from the workers, and torchrun's failure policy: the first rank to fail is named and
stops the others within the grace."""

import os
import time
from pathlib import Path

import pytest

from runners.launch import DIRECT_GRACE_S, RunFailed, Where, direct_launch, run_workers

MODULE = "tests.integration.launch_worker"


def test_which_launches_go_without_torchrun(monkeypatch):
    monkeypatch.delenv("PLANNER_TORCHRUN", raising=False)
    assert direct_launch(Where(nproc=4))
    assert not direct_launch(Where(nproc=2, max_restarts=1))  # torchrun's agent restarts the workers
    assert not direct_launch(Where(nproc=2, nnodes=2, rdzv_endpoint="10.0.0.1:29500"))
    assert not direct_launch(Where(nproc=2, cluster="pl"))
    monkeypatch.setenv("PLANNER_TORCHRUN", "1")
    assert not direct_launch(Where(nproc=4))


def test_every_rank_gets_torchruns_environment_and_rank_0_reports():
    events = []
    result = run_workers(MODULE, {}, where=Where(nproc=2), on_event=events.append)
    assert result["RANK"] == "0" and result["LOCAL_RANK"] == "0"
    assert result["WORLD_SIZE"] == result["LOCAL_WORLD_SIZE"] == "2"
    assert result["MASTER_ADDR"] == "127.0.0.1" and int(result["MASTER_PORT"]) > 0
    assert int(result["OMP_NUM_THREADS"]) >= 1
    assert sorted(e["rank"] for e in events if e["kind"] == "hello") == [0, 1]


@pytest.mark.parametrize("how,expected", [("raise", r"rank 1 failed: RuntimeError: told to fail"),
                                          ("kill", r"rank 1 failed \(killed by signal 9\)")])
def test_the_first_failed_rank_is_named_and_stops_the_others(how, expected):
    start = time.monotonic()
    with pytest.raises(RunFailed, match=expected):
        run_workers(MODULE, {"fail_rank": 1, "how": how}, where=Where(nproc=2))
    # rank 0 sleeps 60 s unless the launcher stops it
    assert time.monotonic() - start < 30 + DIRECT_GRACE_S


def test_a_worker_that_outlives_its_group_leader_is_killed(tmp_path):
    """runners.launch._kill_groups: a group counts as running while any member does, so a member that
    ignores SIGTERM after its leader exited on it (torchrun before the worker it started) is SIGKILLed."""
    import signal
    import subprocess
    import sys

    from runners.launch import _kill_groups

    pid_file = tmp_path / "child.pid"
    child = ("import os, signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
             "open(sys.argv[1], 'w').write(str(os.getpid())); time.sleep(120)")
    leader = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                               f"subprocess.Popen([sys.executable, '-c', {child!r}, sys.argv[1]]); time.sleep(120)",
                               str(pid_file)], start_new_session=True)
    deadline = time.monotonic() + 30
    while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    worker = int(pid_file.read_text())
    start = time.monotonic()
    _kill_groups([leader], grace_s=0.5)
    assert leader.poll() == -signal.SIGTERM and time.monotonic() - start < 8
    stat = Path(f"/proc/{worker}/stat")  # gone, or a zombie no init reaped yet
    assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")


def test_a_ctrl_c_while_a_worker_starts_still_leaves_the_worker_recorded():
    """runners.interrupts.interrupt_deferred: a SIGINT arriving inside the block (here: right after Popen's fork,
    where KeyboardInterrupt used to escape before the child was recorded) is raised when the block ends, so
    the started child is in the list the launcher stops; outside a block Ctrl-C acts at once as before."""
    import signal
    import subprocess
    import sys

    from runners.interrupts import interrupt_deferred
    from runners.launch import _kill_groups

    # Python's own handler, as a terminal run has it (a run in a shell's background inherits SIGINT ignored)
    outer = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        started: list[subprocess.Popen] = []
        with pytest.raises(KeyboardInterrupt):
            with interrupt_deferred():
                child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.2)  # the handler has run by now; without the deferral the append below never happens
                started.append(child)
        assert started == [child] and child.poll() is None
        _kill_groups(started, grace_s=2.0)
        assert child.poll() == -signal.SIGTERM
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.2)
    finally:
        signal.signal(signal.SIGINT, outer)
