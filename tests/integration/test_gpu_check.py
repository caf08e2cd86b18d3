"""`bash benchmarks/gpu_check.sh --dry-run`: the one-GPU check's every step on CPU at tiny sizes, so that its
one run on a lent GPU meets no surprise: every step runs, the summary has every check with its numbers,
the exactness steps (several ranks over gloo, against one process) pass here too, and the verdicts can
be re-judged from the written file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_check  # noqa: E402


def test_the_dry_run_runs_every_step_and_writes_the_summary(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"}
    result = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--dry-run"], env=env, cwd=ROOT,
                            capture_output=True, text=True, timeout=1800)
    summary_path = tmp_path / "gpu_check.json"
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    summary = json.loads(summary_path.read_text())
    assert summary["mode"] == "dry-run" and summary["passed"] and not summary["verdicts_enforced"]
    assert set(summary["checks"]) == set(gpu_check.expected_checks())
    assert not summary["missing"] and not summary["errors"]
    checks = summary["checks"]
    assert checks["profile"]["links_from"].startswith("cpu preset")  # one process: said so
    for rc in gpu_check.RECOMPUTE:
        run = checks[f"bf16_recompute_{rc}"]
        assert run["precision"] == "fp32" and run["measured_step_time_s"] > 0 and "step_time_error" in run
    assert checks["fp16_loss_scaling"]["ok"] and checks["fp16_loss_scaling"]["precision"] == "fp16"
    for name, *_ in gpu_check.EXACT:  # exactness holds on CPU as on the GPU
        assert checks[f"exact_{name}"]["ok"], checks[f"exact_{name}"]
    assert checks["exact_maz3_host"]["comm_bytes"]["host_device"] > 0
    assert checks["validate_calibrate"]["ok"] and checks["validate_calibrate"]["precision"] == "fp32"
    assert (tmp_path / "gpu_check.log").read_text().count("PASS") >= len(gpu_check.EXACT)
    again = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--verdicts", str(summary_path)],
                           capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert again.returncode == 0 and json.loads(again.stdout)["passed"]
