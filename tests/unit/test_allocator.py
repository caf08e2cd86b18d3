"""Every worker keeps the memory it frees (runners/launch.steady_allocator): a step's transient tensors reuse
the pages the previous step touched instead of faulting in fresh ones, so CPU timings do not depend on what
a process freed before."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from runners.launch import CHECKOUT

# The engine's ring steps at a 1024-token side (runners/probe._ring_block_calls: the square's and a half
# block's forward and backward, 4 heads, fp32 score blocks of 8 and 16 MiB), 6 rounds to warm up, then the
# minor page faults of 6 more. With glibc's defaults this read 32,288 faults every round (126 MiB of fresh
# pages; 8 rounds 2.06 s), with steady_allocator 0 from the third round on (1.20 s), now and then one 16 MiB
# block's 4,096 in a later round.
FAULTS_SCRIPT = """
import dataclasses, json, resource, sys, torch
from runners.launch import steady_allocator
from runners.probe import _ring_block_calls
from specs.model import PRESETS
steady = steady_allocator() if sys.argv[1] == "steady" else None
model = dataclasses.replace(PRESETS["tiny"], hidden_size=128, num_heads=4, num_kv_heads=4, max_seq_len=4096)
calls = _ring_block_calls(model, side=1024, device=torch.device("cpu"))
faults = []
for _ in range(12):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for call in calls:
        call()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"steady": steady, "faults": sum(faults[6:]), "rounds": faults}))
"""


def _run(script: str, *args: str) -> dict:
    """The JSON line `script` prints last, run in a fresh interpreter (the allocator setting is per process)."""
    out = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, check=True,
                         cwd=CHECKOUT, env={"OMP_NUM_THREADS": "1", "PYTHONPATH": CHECKOUT})
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_freed_blocks_are_reused_without_page_faults():
    steady = _run(FAULTS_SCRIPT, "steady")
    if not steady["steady"]:
        pytest.skip("no glibc mallopt here: the C library's defaults stay")
    assert steady["faults"] < 10_000, steady  # two blocks at most, where the defaults fault 32,288 every round


def test_every_worker_sets_it_before_its_task(tmp_path, monkeypatch):
    import runners.launch as launch

    seen: list[str] = []
    monkeypatch.setattr(launch, "steady_allocator", lambda: seen.append("allocator") or True)
    (tmp_path / "spec.json").write_text(json.dumps({"x": 1}))
    code = launch.worker_main(lambda spec: seen.append("task") or {"ok": spec["x"]}, ["--work-dir", str(tmp_path)])
    assert code == 0 and seen == ["allocator", "task"]
    assert json.loads((tmp_path / "result.json").read_text()) == {"ok": 1}


RELEASE_SCRIPT = """
import json, torch
from runners.launch import release_free_memory, steady_allocator
from runners.train import memory_now_bytes
cpu = torch.device("cpu")
steady = steady_allocator()
base = memory_now_bytes(cpu)
held = torch.ones(2**24)  # 64 MiB
del held
kept = memory_now_bytes(cpu) - base
release_free_memory()
print(json.dumps({"steady": steady, "kept": kept, "after": memory_now_bytes(cpu) - base}))
"""


def test_a_memory_figure_starts_from_live_memory_not_what_was_freed():
    """steady_allocator keeps freed blocks resident; reset_peak_memory and the activation probe's idle figure
    give them back first (release_free_memory), or a run would be charged what an earlier one freed."""
    figures = _run(RELEASE_SCRIPT)
    if not figures["steady"]:
        pytest.skip("no glibc mallopt here: freed blocks go back by the C library's defaults")
    assert figures["kept"] > 56 * 2**20 and figures["after"] < 8 * 2**20, figures
