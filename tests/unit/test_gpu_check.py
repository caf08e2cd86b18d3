"""benchmarks/gpu_check.py's judgement of a GPU run, on made-up results (the GPU run itself happens once,
on a lent machine): every target of issue 11 is checked with the right reference, a missing or failed
step fails the check, and a dry run is judged only on having run."""

from __future__ import annotations

import copy
import importlib.util
import sys
from pathlib import Path

import pytest

PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"
spec = importlib.util.spec_from_file_location("gpu_check", PATH)
gpu_check = importlib.util.module_from_spec(spec)
sys.modules["gpu_check"] = gpu_check  # its dataclasses look their module up
spec.loader.exec_module(gpu_check)

GIB = 2**30


def run_metrics(*, measured_s: float, predicted_s: float, peak: int, predicted_peak: int, losses=(11.8, 11.6, 11.4),
                precision: str = "bf16", skipped: int = 0) -> dict:
    return {"plan": {}, "steps": [{"step": i, "loss": l, "step_time_s": measured_s} for i, l in enumerate(losses)],
            "summary": {"median_step_time_s": measured_s, "peak_memory_bytes": peak, "precision": precision,
                        "skipped_steps": skipped, "loss_scale": 65536.0},
            "predicted": {"step_time_s": predicted_s, "peak_memory_bytes": predicted_peak,
                          "breakdown": {"framework_reserve_bytes": 2 * GIB}}}


def good_raw() -> dict:
    """What a passing H200 run would return."""
    raw = {"errors": {}, "env": {"cuda": True},
           "profile": {"path": "p.json", "gemm_asymptote_flops_per_s": 760e12, "gemm_dtype": "bf16", "links_from": "h200"},
           "gemm": {"dim": 8192, "dtype": "bf16", "torch_flops_per_s": 790e12},
           "run_fp16": {"plan": "mb4 rc=none", "metrics": run_metrics(measured_s=0.5, predicted_s=0.5, peak=30 * GIB,
                                                                        predicted_peak=32 * GIB, precision="fp16",
                                                                        losses=(11.81, 11.65, 11.45), skipped=1)},
           "exact": {name: {"plan": name, "ranks": ranks, "losses": [5.5, 5.4], "reference_losses": [5.5, 5.40005],
                            "comm_bytes": {}, "device": "cuda"} for name, ranks, *_ in gpu_check.EXACT},
           "validate": {"hardware": "h200", "precision": "bf16", "plans": [{"label": "dp mb1", "status": "ok"}],
                        "calibration": {}}}
    for rc in gpu_check.RECOMPUTE:
        # 20 GiB of tensors measured; the estimate says 22 GiB including its 2 GiB reserve: exact.
        raw[f"run_{rc}"] = {"plan": f"rc={rc}", "metrics": run_metrics(measured_s=0.40, predicted_s=0.44,
                                                                       peak=20 * GIB, predicted_peak=22 * GIB)}
    return raw


def test_a_good_gpu_run_passes_with_its_numbers():
    summary = gpu_check.verdicts(good_raw(), enforce=True)
    assert summary["passed"] and not summary["failed"] and not summary["missing"]
    assert set(summary["checks"]) == set(gpu_check.expected_checks())
    run = summary["checks"]["bf16_recompute_full"]
    assert run["step_time_error"] == pytest.approx(0.10)
    assert run["memory_error"] == pytest.approx(0.0)  # the reserve is no tensor: compared without it
    assert summary["checks"]["gemm_vs_torch"]["ratio"] == pytest.approx(760 / 790)
    assert summary["checks"]["exact_zero3"]["max_loss_diff"] == pytest.approx(5e-5)


@pytest.mark.parametrize("change,failing", [
    (lambda r: r["run_none"]["metrics"]["summary"].update(median_step_time_s=0.30), "bf16_recompute_none"),  # +47%
    (lambda r: r["run_full"]["metrics"]["summary"].update(peak_memory_bytes=17 * GIB), "bf16_recompute_full"),
    (lambda r: r["gemm"].update(torch_flops_per_s=900e12), "gemm_vs_torch"),
    (lambda r: r["exact"]["lins_2_2_4"].update(losses=[5.5, 5.41]), "exact_lins_2_2_4"),
    (lambda r: r["run_fp16"]["metrics"]["steps"][2].update(loss=float("nan")), "fp16_loss_scaling"),
    (lambda r: r["run_fp16"]["metrics"]["summary"].update(skipped_steps=5), "fp16_loss_scaling"),
    (lambda r: r["run_fp16"]["metrics"]["steps"][0].update(loss=12.5), "fp16_loss_scaling"),  # not bf16's first loss
    (lambda r: r["validate"]["plans"].append({"label": "dp mb2", "status": "failed"}), "validate_calibrate"),
    (lambda r: r["run_selective"]["metrics"].update(predicted=None), "bf16_recompute_selective"),
])
def test_each_target_fails_the_check_when_missed(change, failing):
    raw = good_raw()
    change(raw)
    summary = gpu_check.verdicts(raw, enforce=True)
    assert summary["failed"] == [failing] and not summary["passed"]
    # A dry run judges only that every step ran.
    assert gpu_check.verdicts(raw, enforce=False)["passed"]


def test_a_step_that_did_not_run_fails_even_a_dry_run():
    raw = good_raw()
    del raw["run_selective"]
    assert gpu_check.verdicts(raw, enforce=False)["missing"] == ["bf16_recompute_selective"]
    raw = good_raw()
    raw["errors"]["fp16_loss_scaling"] = "RuntimeError: planner run exited 1"
    del raw["run_fp16"]
    summary = gpu_check.verdicts(copy.deepcopy(raw), enforce=False)
    assert not summary["passed"] and summary["errors"] == ["fp16_loss_scaling"]
    assert summary["checks"]["fp16_loss_scaling"]["error"].startswith("RuntimeError")
