"""Launch a training run under torchrun on this node (or one node of several) and collect its metrics.

A failed rank is named in one line (from the error file each rank writes, or torchrun's failure
summary); Ctrl-C or a dead rank stops every process of the run: the whole torchrun process group is
killed, so nothing is orphaned.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
from collections import deque
from pathlib import Path

from specs.errors import PlannerError
from specs.jsonio import read_json_file, write_json_atomic
from runners.train import STEP_PREFIX, RunConfig


class RunFailed(RuntimeError):
    """A rank failed for a reason other than bad input."""


def torchrun_command(*, nproc: int, nnodes: int, node_rank: int, rdzv_endpoint: str | None, run_args: list[str],
                     max_restarts: int = 0) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}"]
    if nnodes == 1 and not rdzv_endpoint:
        cmd.append("--standalone")
    else:
        if not rdzv_endpoint:
            raise PlannerError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT")
        cmd += [f"--nnodes={nnodes}", f"--node-rank={node_rank}", "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}"]
    return cmd + ["-m", "runners.train", *run_args]


def _failure_message(error_dir: Path, stderr_tail: list[str], returncode: int) -> tuple[str, bool]:
    """(message naming the failed rank, whether it was bad input)."""
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
    text = "\n".join(stderr_tail)
    # torchrun's summary lists the root cause (first observed failure) after the other failures, which
    # are usually the ranks its agent then stopped with SIGTERM.
    text = text[text.rfind("Root Cause"):] if "Root Cause" in text else text
    match = re.search(r"^\s*rank\s*:\s*(\d+).*?^\s*exitcode\s*:\s*(-?\d+)", text, re.S | re.M)
    if match:
        code = int(match.group(2))
        how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
        return f"rank {match.group(1)} failed ({how})", False
    return f"the run failed (exit code {returncode}); last output:\n" + "\n".join(stderr_tail[-15:]), False


def launch(cfg: RunConfig, *, nproc: int, nnodes: int = 1, node_rank: int = 0, rdzv_endpoint: str | None = None,
           on_step=None, env: dict | None = None, max_restarts: int = 0) -> dict | None:
    """Run `cfg` under torchrun; returns the metrics (None on nodes other than node 0 of several).

    With max_restarts > 0 torchrun restarts every worker after a failure (up to that many times) and the
    workers resume from the newest checkpoint in cfg.checkpoint_dir."""
    with tempfile.TemporaryDirectory(prefix="planner-run-") as tmp:
        tmp_path = Path(tmp)
        config_path, metrics_path, error_dir = tmp_path / "run.json", tmp_path / "metrics.json", tmp_path / "errors"
        error_dir.mkdir()
        write_json_atomic(config_path, cfg.to_dict())
        cmd = torchrun_command(nproc=nproc, nnodes=nnodes, node_rank=node_rank, rdzv_endpoint=rdzv_endpoint,
                               run_args=["--config", str(config_path), "--metrics-out", str(metrics_path),
                                         "--error-dir", str(error_dir)], max_restarts=max_restarts)
        child_env = {**os.environ, **(env or {})}
        child_env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // max(1, nproc))))
        child_env["PYTHONUNBUFFERED"] = "1"
        child_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]),
                                                               child_env.get("PYTHONPATH")]))
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env,
                                start_new_session=True)
        tail: deque[str] = deque(maxlen=200)
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                line = line.rstrip("\n")
                if line.startswith(STEP_PREFIX):
                    if on_step is not None:
                        on_step(json.loads(line[len(STEP_PREFIX):]))
                else:
                    tail.append(line)
            returncode = proc.wait()
        except KeyboardInterrupt:
            _kill_group(proc)
            raise
        finally:
            if proc.poll() is None:
                _kill_group(proc)
        return _outcome(returncode, error_dir=error_dir, tail=list(tail), metrics_path=metrics_path)


def _outcome(returncode: int, *, error_dir: Path, tail: list[str], metrics_path: Path) -> dict | None:
    """The run's metrics (None where this node wrote none), or the failure raised naming the rank."""
    if returncode != 0:
        message, bad_input = _failure_message(error_dir, tail, returncode)
        raise (PlannerError if bad_input else RunFailed)(message)
    if not metrics_path.exists():
        return None
    return read_json_file(metrics_path, what="metrics")


def _kill_group(proc: subprocess.Popen) -> None:
    """Stop torchrun and every worker it started (they share its process group)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=10)
            return
        except subprocess.TimeoutExpired:
            continue


def cluster_worker_env(world: int) -> dict[str, str]:
    """What every worker on the emulated cluster's nodes needs beside node_env: this host's cores split
    over all `world` ranks (the nodes share them), unbuffered output, and this checkout importable."""
    return {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // world)), "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]),
                                                       os.environ.get("PYTHONPATH")]))}


def launch_on_emulated_cluster(cfg: RunConfig, *, prefix: str, on_step=None) -> dict | None:
    """Run `cfg` across the nodes of an emulated cluster (`planner cluster up --prefix`): one torchrun per
    network namespace, rendezvousing on node 0, exactly as on real nodes; returns the metrics.

    The namespaces share this machine's file system, so the config, metrics and error files live in one
    temporary directory every node sees. A failed rank is named as by `launch`."""
    from runners import netns_cluster as nc

    state = nc.load_state(prefix)
    world = state.num_nodes * state.procs_per_node
    with tempfile.TemporaryDirectory(prefix="planner-run-") as tmp:
        tmp_path = Path(tmp)
        config_path, metrics_path, error_dir = tmp_path / "run.json", tmp_path / "metrics.json", tmp_path / "errors"
        error_dir.mkdir()
        write_json_atomic(config_path, cfg.to_dict())
        module_argv = ["-m", "runners.train", "--config", str(config_path), "--metrics-out", str(metrics_path),
                       "--error-dir", str(error_dir)]
        argv = [nc.torchrun_argv(state, node, module_argv) for node in range(state.num_nodes)]
        env = cluster_worker_env(world)
        tail: deque[str] = deque(maxlen=200)

        def on_line(node: int, line: str) -> None:
            if line.startswith(STEP_PREFIX):
                if on_step is not None and node == 0:
                    on_step(json.loads(line[len(STEP_PREFIX):]))
            else:
                tail.append(f"[n{node}] {line}")

        returncode = nc.launch_on_cluster(state, argv, env=env, on_line=on_line)
        return _outcome(returncode, error_dir=error_dir, tail=list(tail), metrics_path=metrics_path)
