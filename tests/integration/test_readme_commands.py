"""Every `planner ...` line README.md shows in a command block runs, in order, in one folder, so the README
cannot drift from the CLI. Lines that train, profile or validate for minutes run with smaller sizes, each
through the substitution table below (the README line on the left, what runs on the right, and why); every
other line runs exactly as written. The emulated-cluster lines need root and network namespaces, so they run
where tests/integration/test_netns_cluster.py runs (and are skipped with its reason elsewhere).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import seed_profile_cache

README = Path(__file__).resolve().parents[2] / "README.md"
CLUSTER_PREFIX = "plreadme"  # not the default, so a cluster someone else brought up on this host is left alone
STEPS = "--steps 2"  # two steps show the run trains; the README's step counts only take longer

# README line (comment dropped, spaces collapsed) -> what the test runs instead.
SUBSTITUTIONS = {
    # The profile's probes need no more than two message sizes to fit latency and bandwidth, and its layer
    # probe a fraction of a second per point to show that it runs.
    "planner profile --quick --nproc 2 --out profile.json": "planner profile --quick --nproc 2 --out profile.json "
                                                           "--sizes 4k,64k --probe-seconds 0.3",
    "planner run --plan local.json": f"planner run --plan local.json {STEPS}",
    "planner run --nproc 4 --zero 3 --micro-batch 2 --steps 20": f"planner run --nproc 4 --zero 3 --micro-batch 2 {STEPS}",
    "planner run --nproc 4 --tp 2 --pp 2 --schedule 1f1b --format json":
        f"planner run --nproc 4 --tp 2 --pp 2 --schedule 1f1b --format json {STEPS}",
    "planner run --nproc 4 --zero 3 --engine torch": f"planner run --nproc 4 --zero 3 --engine torch {STEPS}",
    "planner run --nproc 2 --tp 2 --sequence-parallel --engine torch":
        f"planner run --nproc 2 --tp 2 --sequence-parallel --engine torch {STEPS}",
    # Two plans on two processes instead of the search's top plans and the spread on four.
    "planner validate --nproc 4 --hardware profile.json --out validate.json":
        "planner validate --nproc 2 --hardware profile.json --out validate.json --top 2 --no-spread --max-plans 2 "
        "--steps 3",
    # The defaults (this machine's cached profile, its process count) on two plans and two timing rounds.
    "planner validate --max-plans 4 --out local-validate.json":
        "planner validate --max-plans 2 --top 1 --no-spread --steps 3 --timing-rounds 2 --out local-validate.json",
    # Two measured plans fit one parameter (one plan fitted, one held out).
    "planner calibrate --measurements validate.json --hardware profile.json --out calibrated.json":
        "planner calibrate --measurements validate.json --hardware profile.json --out calibrated.json "
        "--parameters op_overhead_s",
    # tune with no arguments profiles and calibrates a fresh cache; here it takes the profile calibrated above.
    "planner tune": f"planner tune --profile calibrated.json {STEPS}",
    "planner cluster up --nodes 2 --procs-per-node 2 --inter-node-bandwidth 1gbit":
        f"planner cluster up --nodes 2 --procs-per-node 2 --inter-node-bandwidth 1gbit --prefix {CLUSTER_PREFIX}",
    "planner profile --cluster --quick --out cluster-profile.json":
        f"planner profile --cluster --quick --out cluster-profile.json --sizes 4k,64k --probe-seconds 0.3 "
        f"--cluster-prefix {CLUSTER_PREFIX}",
    "planner validate --cluster --hardware cluster-profile.json":
        f"planner validate --cluster --hardware cluster-profile.json --top 1 --no-spread --max-plans 1 --steps 2 "
        f"--cluster-prefix {CLUSTER_PREFIX}",
    "planner run --cluster --elastic 1:2 --hardware cluster-profile.json --checkpoint-dir ckpt --mtbf 600 "
    "--max-restarts 3 --steps 40":
        f"planner run --cluster --elastic 1:2 --hardware cluster-profile.json --checkpoint-dir ckpt --mtbf 600 "
        f"--max-restarts 3 {STEPS} --cluster-prefix {CLUSTER_PREFIX}",
    "planner cluster down": f"planner cluster down --prefix {CLUSTER_PREFIX}",
}


def readme_lines() -> list[str]:
    """The `planner` lines of README.md's indented command blocks, comments dropped, spaces collapsed."""
    lines = []
    for raw in README.read_text().splitlines():
        if re.match(r"^ {4}planner\s", raw):
            lines.append(" ".join(raw.split("#", 1)[0].split()))
    return lines


def _netns_skip_reason() -> str | None:
    from tests.integration.test_netns_cluster import _skip_reason

    return _skip_reason()


LINES = readme_lines()


def test_the_readme_has_its_command_list_and_every_substitution_is_used():
    assert len(LINES) >= 15 and "planner search" in " ".join(LINES)
    assert not set(SUBSTITUTIONS) - set(LINES), "a substitution for a line the README no longer has"
    assert all("|" not in line for line in LINES), "a README command is a shell pipeline"


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("readme")
    seed_profile_cache(folder / "cache")  # this machine's profiles, which the lines without --hardware use
    yield folder
    if any(line.startswith("planner cluster up") for line in LINES) and _netns_skip_reason() is None:
        subprocess.run([sys.executable, "-m", "planner.cli", "cluster", "down", "--prefix", CLUSTER_PREFIX],
                       capture_output=True, env={**os.environ, "PLANNER_CLUSTER_STATE_DIR": str(folder)}, timeout=300)


@pytest.mark.parametrize("line", LINES)
def test_readme_line_runs(line, workdir):
    if "--cluster" in line or line.startswith("planner cluster"):
        reason = _netns_skip_reason()
        if reason is not None:
            pytest.skip(f"the emulated cluster {reason}")
    command = SUBSTITUTIONS.get(line, line)
    bin_dir = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""),
           "PLANNER_CLUSTER_STATE_DIR": str(workdir), "PLANNER_CACHE_DIR": str(workdir / "cache")}
    proc = subprocess.run(["bash", "-c", command], cwd=workdir, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{command}\n{proc.stdout[-1500:]}\n{proc.stderr[-3000:]}"
    assert "Traceback" not in proc.stderr
