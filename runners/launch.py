"""The one launcher: every multi-process job of the project starts here, with one environment policy and
one protocol for progress, results and failures.

    metrics = launch(cfg, where=Where(nproc=4))                       # a training run
    result = run_workers("profilers.comm", spec, where=Where(nproc=2))  # any worker module

Where: `nproc` local processes (started by the launcher itself, as torchrun --standalone would, or by
torchrun when it restarts them: `direct_launch`), one node of several real ones (--nnodes, --node-rank,
--rdzv-endpoint), or every node of an emulated cluster (runners/netns_cluster.py: one torchrun per
network namespace, rendezvousing on node 0).

Environment policy (`worker_env`): the processes on one host share its cores, so each gets
OMP_NUM_THREADS = cores // processes on the host (at least 1; the emulated nodes share one host);
unbuffered output; this checkout importable. Every worker keeps the memory it frees (`steady_allocator`).

Protocol: a worker module is run as `python -m <module> --work-dir DIR` on every rank; it reads
DIR/spec.json, rank 0 writes DIR/result.json, prints progress as `PLANNER_EVENT {json}` lines
(`emit_event`), and a failing rank writes DIR/errors/rank<N>.json (`worker_main` does all of this
around a task function). A failed rank is named in one line (from those files, else the first rank the
launcher or torchrun saw fail); bad input on any rank is raised as PlannerError. Ctrl-C or a dead rank
stops every process of the run: every worker's session, the whole torchrun process group or every
namespace's tree is killed, nothing orphaned.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from runners.interrupts import interrupt_deferred
from specs.errors import PlannerError
from specs.jsonio import read_json_file, write_json_atomic

EVENT_PREFIX = "PLANNER_EVENT "
CHECKOUT = str(Path(__file__).resolve().parents[1])


class RunFailed(RuntimeError):
    """A rank failed for a reason other than bad input."""


@dataclass(frozen=True)
class Where:
    """Where the workers run: nproc local processes, one node of a multi-node job, or an emulated cluster."""

    nproc: int = 1
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None
    cluster: str | None = None  # name prefix of an emulated cluster (`planner cluster up`)
    max_restarts: int = 0
    # (min, max) nodes of an elastic run (runners/elastic.py); None: a fixed set of nodes.
    elastic: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.nproc < 1 or self.nnodes < 1:
            raise PlannerError(f"--nproc and --nnodes must be at least 1, got {self.nproc} and {self.nnodes}")
        if self.nnodes > 1 and not self.rdzv_endpoint and not self.elastic:
            raise PlannerError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT")
        if self.elastic is not None:
            if self.cluster is None and not self.rdzv_endpoint:
                raise PlannerError("--elastic needs the nodes' rendezvous: --rdzv-endpoint HOST:PORT, or --cluster")
            if self.max_restarts < 1:
                raise PlannerError("--elastic needs --max-restarts N >= 1 (the failures the run survives)")

    def topology(self) -> tuple[int, int]:
        """(world size, ranks per node)."""
        if self.cluster is not None:
            from runners.netns_cluster import load_state

            state = load_state(self.cluster)
            return state.num_nodes * state.procs_per_node, state.procs_per_node
        return self.nproc * self.nnodes, self.nproc

    def procs_on_host(self) -> int:
        """Processes sharing this host's cores: every rank on an emulated cluster, else this node's."""
        return self.topology()[0] if self.cluster is not None else self.nproc


# --- the environment policy -------------------------------------------------------------------------
def num_cores() -> int:
    """The cores this process may run on (its affinity mask, as torch's thread pool sees them): what the
    workers of one host share, and what a profile records it was measured on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def worker_env(*, procs_on_host: int) -> dict[str, str]:
    """What every worker needs: its share of the host's cores, unbuffered output, this checkout importable.
    An OMP_NUM_THREADS the user set is kept."""
    return {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS") or str(max(1, num_cores() // procs_on_host)),
            "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [CHECKOUT, os.environ.get("PYTHONPATH")]))}


# glibc's malloc hands blocks above its mmap threshold (128 KiB at first, raised up to 32 MiB by the blocks freed)
# back to the kernel when freed, and trims the heap's top beyond twice that threshold; the next step's
# tensors of the same sizes then fault in fresh zeroed pages. A CPU step's transient tensors are large and
# recur every step (the ring's fp32 score blocks: 16 MiB for 4 heads at a 1024-token side), so which of
# them fault depends on what the process freed before. Measured on this project's 2-core host, 4 ranks, the
# 4096-token benchmark model: the cp4 ring's step 12.0 / 12.1 s with glibc's defaults, 9.0 / 9.2 s with both
# thresholds fixed high (dp4's 4.6-5.2 s either way); the probe's 1024-token ring square forward 169-235 ms
# against 103-142, a half block's 45-72 against 32-46; either threshold alone was slower than the defaults.
STEADY_MMAP_THRESHOLD = 2**30
STEADY_TRIM_THRESHOLD = 2**30
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters


def steady_allocator() -> bool:
    """Keep this process's freed memory for its next allocations (glibc's mallopt: blocks up to
    STEADY_MMAP_THRESHOLD from the heap, the heap's free top kept up to STEADY_TRIM_THRESHOLD), so every
    step reuses the pages the previous one touched and times the same whatever ran before. The freed memory
    stays resident, so a memory figure starts with `release_free_memory`. False where the C library has no
    mallopt (not glibc) or refuses: the defaults stay."""
    import ctypes

    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, STEADY_MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD,
                                                                                      STEADY_TRIM_THRESHOLD))


def release_free_memory() -> None:
    """Give the memory this process holds freed back to the kernel (glibc's malloc_trim), where a memory
    figure is about to start: with `steady_allocator` the resident set also holds what earlier runs in
    the process freed, which is no part of the next run's memory. A no-op without glibc."""
    import ctypes

    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is not None:
        trim(0)


# --- the worker side --------------------------------------------------------------------------------
def pick_device() -> tuple["torch.device", str]:
    """This rank's device and collective backend (call once per worker, before init_process_group).

    CUDA: GPU LOCAL_RANK modulo the visible GPUs (more ranks than GPUs share them, e.g. several ranks on a
    one-GPU machine), NCCL when every local rank has a GPU of its own, else gloo, which runs collectives
    on CUDA tensors through host copies (NCCL refuses two ranks on one device). Without CUDA: CPU, gloo.
    """
    import torch

    if not torch.cuda.is_available():
        return torch.device("cpu"), "gloo"
    count = torch.cuda.device_count()
    local = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    device = torch.device("cuda", local % count)
    torch.cuda.set_device(device)
    return device, ("nccl" if local_world <= count else "gloo")


def emit_event(kind: str, **fields: object) -> None:
    """Print one progress event for the launcher (rank 0 only, but for `failed`), stamped with the wall
    time (the nodes of an emulated cluster share the host's clock)."""
    print(EVENT_PREFIX + json.dumps({"kind": kind, "time": time.time(), **fields}), flush=True)


def _parse_event(line: str) -> dict | None:
    if not line.startswith(EVENT_PREFIX):
        return None
    try:
        event = json.loads(line[len(EVENT_PREFIX):])
    except json.JSONDecodeError:
        return None
    return event if isinstance(event, dict) else None


def report_failure(work_dir: str | Path, *, rank: int, message: str, bad_input: bool, detail: str = "") -> None:
    """Write this rank's failure where the launcher looks for it."""
    write_json_atomic(Path(work_dir) / "errors" / f"rank{rank}.json",
                      {"rank": rank, "host": socket.gethostname(), "error": message, "bad_input": bad_input,
                       "traceback": detail})


def worker_main(task: Callable[[dict], object], argv: list[str] | None = None) -> int:
    """The body of every worker module's `__main__`: read DIR/spec.json, run `task(spec)` on this rank (its
    freed memory kept: `steady_allocator`), write its result (rank 0; an object with to_dict(), a dict or
    None) to DIR/result.json, and report a failure the way the launcher names it. Returns the process exit
    code (2: bad input)."""
    from runners.faults import describe_failure, die_with_parent

    parser = argparse.ArgumentParser()
    parser.add_argument("--work-dir", required=True)
    args = parser.parse_args(argv)
    rank = int(os.environ.get("RANK", 0))
    steady_allocator()
    if "TORCHELASTIC_RUN_ID" in os.environ or os.environ.get("PLANNER_LAUNCHER") == "direct":
        # never outlive the agent or launcher that started this worker
        die_with_parent()
    try:
        result = task(read_json_file(Path(args.work_dir) / "spec.json", what="worker spec"))
        if rank == 0 and result is not None:
            write_json_atomic(Path(args.work_dir) / "result.json", result.to_dict() if hasattr(result, "to_dict") else result)
        return 0
    except (PlannerError, ValueError) as exc:
        report_failure(args.work_dir, rank=rank, message=str(exc), bad_input=True)
        print(f"rank {rank}: error: {exc}", file=sys.stderr, flush=True)
        return 2
    except BaseException as exc:  # noqa: BLE001 - reported by the launcher with the rank's name
        # First, with the time it was seen: an elastic launcher records when the failure was detected.
        emit_event("failed", rank=rank, message=f"{type(exc).__name__}: {exc}".splitlines()[0].split(". ")[0][:300])
        report_failure(args.work_dir, rank=rank, message=describe_failure(exc), bad_input=False,
                       detail=traceback.format_exc())
        traceback.print_exc()
        return 1


def exit_worker(code: int) -> None:
    """End a worker process with `code` (worker_main's). A rank that succeeded has written its result and
    has nothing left to do, so it leaves by os._exit, without the interpreter's teardown, where the process
    groups' C++ objects and threads are destroyed in no defined order. Ranks aborting with SIGABRT (gloo's
    "terminate called without an active exception": a thread destroyed while joinable) at the end of a run
    were seen in ~1 of 30 profile probes and in 2 of 3 fresh-clone CI runs of one validate command, each
    reported by the launcher as a failed rank. A failed rank exits normally (its report is written)."""
    sys.stdout.flush()
    sys.stderr.flush()
    if code == 0:
        os._exit(0)
    sys.exit(code)


# --- the launcher side ------------------------------------------------------------------------------
def torchrun_command(where: Where, module_argv: list[str]) -> list[str]:
    """torchrun for this node (local or one of several real nodes)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={where.nproc}"]
    if where.elastic is not None:
        from runners.elastic import torchrun_elastic_args

        return cmd + torchrun_elastic_args(nodes=where.elastic, endpoint=str(where.rdzv_endpoint), run_id="planner",
                                           max_restarts=where.max_restarts) + module_argv
    cmd.append(f"--max-restarts={where.max_restarts}")
    if where.nnodes == 1 and not where.rdzv_endpoint:
        cmd.append("--standalone")
    else:
        cmd += [f"--nnodes={where.nnodes}", f"--node-rank={where.node_rank}", "--rdzv-backend=c10d",
                f"--rdzv-endpoint={where.rdzv_endpoint}"]
    return cmd + module_argv


def run_workers(module: str, spec: dict, *, where: Where, on_event: Callable[[dict], None] | None = None,
                env: dict[str, str] | None = None, on_node_exit: Callable[[int, int], None] | None = None,
                on_nodes: Callable[[object], None] | None = None) -> dict | None:
    """Run `python -m module --work-dir DIR` on every rank of `where` with DIR/spec.json = spec; returns
    rank 0's DIR/result.json (None where this node wrote none). A failed rank raises RunFailed naming it,
    bad input PlannerError. Events of node 0's rank 0 go to `on_event` (an elastic run's: every node's).
    Elastic runs on the emulated cluster: `on_node_exit(node, code)` when a node other than node 0
    exits, and `on_nodes` gets the runners.netns_cluster.ElasticNodes (fault injection) once started."""
    with tempfile.TemporaryDirectory(prefix="planner-") as tmp:
        work_dir = Path(tmp)  # every emulated node sees it: the namespaces share the file system
        (work_dir / "errors").mkdir()
        write_json_atomic(work_dir / "spec.json", spec)
        module_argv = ["-m", module, "--work-dir", str(work_dir)]
        child_env = {**worker_env(procs_on_host=where.procs_on_host()), **(env or {})}
        if where.elastic is not None:
            from runners.elastic import ELASTIC_ENV

            child_env.update(ELASTIC_ENV)
        tail: deque[str] = deque(maxlen=200)
        first: tuple[int, int] | None = None  # (rank, exit code) a direct launch saw fail first

        def on_line(node: int, line: str) -> None:
            event = _parse_event(line)
            if event is None:
                tail.append(f"[n{node}] {line}" if where.cluster else line)
            elif on_event is not None and (node == 0 or where.elastic is not None):
                on_event(event)

        if where.cluster is not None and where.elastic is not None:
            returncode = _run_elastic_on_cluster(where, module_argv, env=child_env, on_line=on_line,
                                                 on_node_exit=on_node_exit, on_nodes=on_nodes)
        elif where.cluster is not None:
            returncode = _run_on_cluster(where.cluster, module_argv, env=child_env, on_line=on_line)
        elif direct_launch(where):
            returncode, first = _run_direct(where.nproc, module_argv, env=child_env, on_line=on_line)
        else:
            returncode = _run_local(torchrun_command(where, module_argv), env=child_env, on_line=on_line)
        if returncode != 0:
            message, bad_input = _failure_message(work_dir / "errors", list(tail), returncode, first=first)
            raise (PlannerError if bad_input else RunFailed)(message)
        result = work_dir / "result.json"
        return read_json_file(result, what=f"{module} result") if result.exists() else None


def _run_local(cmd: list[str], *, env: dict[str, str], on_line: Callable[[int, str], None]) -> int:
    with interrupt_deferred():
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, **env}, start_new_session=True)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            on_line(0, line.rstrip("\n"))
        return proc.wait()
    finally:
        _kill_groups([proc], grace_s=10.0)  # torchrun and every worker it started share its process group


def direct_launch(where: Where) -> bool:
    """Whether `where` is started without torchrun: local processes that nothing restarts.

    torchrun's agent is one more process that imports torch (3.3 CPU-s on a 2-core host) and holds a
    rendezvous before any worker starts; it is needed for restarts (--max-restarts: the agent restarts
    every worker and keeps its store), elastic runs and several real nodes, not to start N processes on
    one host. Those the launcher starts itself (`_run_direct`), with the same environment torchrun gives
    its workers and the same failure policy: the first rank to fail stops the others. PLANNER_TORCHRUN=1
    starts every launch under torchrun."""
    if os.environ.get("PLANNER_TORCHRUN") == "1":
        return False
    return where.cluster is None and where.elastic is None and where.max_restarts == 0 and where.nnodes == 1 \
        and not where.rdzv_endpoint


# After the first failure the other ranks get SIGTERM, then SIGKILL if they are still there this much later
# (a stopped, hung rank only ends by SIGKILL).
DIRECT_GRACE_S = 5.0


def free_port() -> int:
    """A local TCP port that was free a moment ago (bind to port 0 and let the OS choose)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run_direct(nproc: int, module_argv: list[str], *, env: dict[str, str],
                on_line: Callable[[int, str], None]) -> tuple[int, tuple[int, int] | None]:
    """`nproc` local workers started by this process: (exit code, (rank, code) of the first failure).

    Each worker gets what torchrun --standalone gives its workers (RANK, LOCAL_RANK, WORLD_SIZE,
    LOCAL_WORLD_SIZE, MASTER_ADDR/PORT of a free local port, where rank 0 hosts the store:
    runners.faults.init_distributed) and PLANNER_LAUNCHER, by which it asks to die with this process.
    Each runs in its own session; their output lines reach `on_line` one at a time."""
    base = {**os.environ, **env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
            "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0", "PLANNER_LAUNCHER": "direct"}
    lock = threading.Lock()
    procs: list[subprocess.Popen] = []
    readers: list[threading.Thread] = []

    def pump(proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            with lock:
                on_line(0, line.rstrip("\n"))

    try:
        for rank in range(nproc):
            with interrupt_deferred():  # a Ctrl-C inside Popen would leave a started worker out of `procs`
                procs.append(subprocess.Popen([sys.executable, *module_argv], stdout=subprocess.PIPE,
                                              stderr=subprocess.STDOUT, text=True, start_new_session=True,
                                              env={**base, "RANK": str(rank), "LOCAL_RANK": str(rank),
                                                   "ROLE_RANK": str(rank)}))
            proc = procs[-1]
            readers.append(threading.Thread(target=pump, args=(proc,), daemon=True))
            readers[-1].start()
        first = None
        while first is None:
            codes = [p.poll() for p in procs]
            first = next(((rank, code) for rank, code in enumerate(codes) if code not in (None, 0)), None)
            if first is None and all(code == 0 for code in codes):
                break
            time.sleep(0.05)
        if first is not None:
            _kill_groups(procs, grace_s=DIRECT_GRACE_S)
        for reader in readers:
            reader.join(timeout=5)
        return (0, None) if first is None else (first[1] if first[1] > 0 else 1, first)
    finally:
        _kill_groups(procs, grace_s=DIRECT_GRACE_S)


def _kill_groups(procs: list[subprocess.Popen], *, grace_s: float) -> None:
    """SIGTERM the process group (session) of every process, then SIGKILL what is left of any group after
    `grace_s`: torchrun with its workers, or the workers the launcher started itself. A group counts as
    running while any member does, not only its leader: torchrun can exit on the SIGTERM before a worker
    it started has (a collective worker was seen alive after `planner profile` returned from Ctrl-C)."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        live = _running_groups(procs)
        for proc in live:
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait_s
        while _running_groups(live) and time.monotonic() < deadline:
            time.sleep(0.05)


def _running_groups(procs: list[subprocess.Popen]) -> list[subprocess.Popen]:
    """Those of `procs` whose process group (each leads one) still has a running member, the leaders reaped
    first. A killed member whose parent died stays a zombie until init reaps it, and in a container init
    may never do: on Linux the members are read from /proc once, zombies left out; elsewhere any member the
    kernel still knows counts."""
    for proc in procs:
        proc.poll()
    try:
        pids = [e.name for e in os.scandir("/proc") if e.name.isdigit()]
    except OSError:
        return [p for p in procs if _group_known(p.pid)]
    running = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # state, ppid, pgrp, ... after the command name
        except (OSError, IndexError):
            continue
        if len(fields) > 2 and fields[0] not in ("Z", "X"):
            running.add(int(fields[2]))
    return [p for p in procs if p.pid in running]


def _group_known(pgid: int) -> bool:
    """Whether the kernel still knows a member of process group `pgid` (zombies included)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a member we may not signal: still there
        pass
    return True


def _run_on_cluster(prefix: str, module_argv: list[str], *, env: dict[str, str],
                    on_line: Callable[[int, str], None]) -> int:
    from runners import netns_cluster as nc

    state = nc.load_state(prefix)
    argv = [nc.torchrun_argv(state, node, module_argv) for node in range(state.num_nodes)]
    return nc.launch_on_cluster(state, argv, env=env, on_line=on_line)


def _run_elastic_on_cluster(where: Where, module_argv: list[str], *, env: dict[str, str],
                            on_line: Callable[[int, str], None], on_node_exit, on_nodes) -> int:
    from runners import netns_cluster as nc

    state = nc.load_state(where.cluster)
    argv = [nc.elastic_torchrun_argv(state, node, module_argv, nodes=where.elastic, max_restarts=where.max_restarts)
            for node in range(state.num_nodes)]
    nodes = nc.ElasticNodes(state, argv, env=env, emit=on_line, on_node_exit=on_node_exit)
    if on_nodes is not None:
        on_nodes(nodes)
    return nodes.run()


def _failure_message(error_dir: Path, tail: list[str], returncode: int,
                     first: tuple[int, int] | None = None) -> tuple[str, bool]:
    """(message naming the failed rank, whether it was bad input). `first`: the (rank, exit code) a direct
    launch saw fail first, where torchrun would have printed its failure summary."""
    reports = []
    for path in sorted(error_dir.glob("rank*.json")):
        try:
            reports.append(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError):
            continue
    if reports:
        first = min(reports, key=lambda r: r["rank"])
        if first.get("bad_input"):
            return first["error"], True
        return f"rank {first['rank']} failed: {first['error']}", False
    if first is not None:
        rank, code = first
        return f"rank {rank} failed ({_how(code)})", False
    text = "\n".join(tail)
    # torchrun's summary lists the root cause (first observed failure) after the other failures, which
    # are usually the ranks its agent then stopped with SIGTERM.
    text = text[text.rfind("Root Cause"):] if "Root Cause" in text else text
    match = re.search(r"^\s*rank\s*:\s*(\d+).*?^\s*exitcode\s*:\s*(-?\d+)", text, re.S | re.M)
    if match:
        return f"rank {match.group(1)} failed ({_how(int(match.group(2)))})", False
    return f"the run failed (exit code {returncode}); last output:\n" + "\n".join(tail[-15:]), False


def _how(code: int) -> str:
    return f"killed by signal {-code}" if code < 0 else f"exit code {code}"


# --- training runs ----------------------------------------------------------------------------------
def launch(cfg, *, where: Where, on_step: Callable[[dict], None] | None = None, env: dict[str, str] | None = None,
           on_change: Callable[[object], None] | None = None, on_nodes: Callable[[object], None] | None = None):
    """Train `cfg` (runners.config.RunConfig) on `where`; returns its RunMetrics (None on nodes other
    than node 0 of several). With where.max_restarts > 0 torchrun restarts every worker after a failure
    (up to that many times) and the workers resume from the newest checkpoint in cfg.checkpoint_dir.
    An elastic run (where.elastic) reports each change (runners.config.ElasticEvent) to `on_change` as it
    happens, and its metrics hold every step's final record and the changes; `on_nodes`: see run_workers."""
    import dataclasses

    from runners.config import RunMetrics
    from runners.elastic import ElasticLog

    log = ElasticLog()
    lock = threading.Lock()  # events arrive on one thread per node, node exits on the waiting thread

    def changed(made) -> None:
        for change in made:
            if on_change is not None:
                on_change(change)

    def on_event(event: dict) -> None:
        with lock:
            if where.elastic is not None:
                changed(log.on_event(event))
            if event.get("kind") == "step" and not event.get("replayed") and on_step is not None:
                on_step(event)

    def on_node_exit(node: int, code: int) -> None:
        with lock:
            changed(log.lost(f"node {node}'s agent exited ({_how(code)})"))

    result = run_workers("runners.train", cfg.to_dict(), where=where, on_event=on_event, env=env,
                         on_node_exit=on_node_exit, on_nodes=on_nodes)
    if result is None:
        return None
    metrics = RunMetrics.from_dict(result)
    if where.elastic is None:
        return metrics
    return dataclasses.replace(metrics, steps=log.merged_steps(), events=tuple(log.events))
