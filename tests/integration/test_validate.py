"""planner validate -> calibrate -> explain end to end on the tiny model with 2 local processes (few plans, few steps)."""

from __future__ import annotations

import json
import statistics

from typer.testing import CliRunner

import pytest

from cost_models.estimate import estimate
from planner.cli import app
from specs.hardware import resolve_hardware
from specs.plan import Plan
from specs.problem import make_problem

runner = CliRunner()


def test_validate_then_calibrate_then_explain(tmp_path):
    report_path, png = tmp_path / "v.json", tmp_path / "v.png"
    result = runner.invoke(app, ["validate", "--nproc", "2", "--global-batch", "4", "--top", "1", "--max-plans", "2",
                                 "--steps", "3", "--timing-rounds", "2", "--out", str(report_path), "--png", str(png),
                                 "--format", "json"])
    assert result.exit_code == 0, result.output
    report = json.loads(report_path.read_text())
    assert report["num_plans"] == 2 and report["plans"][0]["source"] == "search"
    ok = [r for r in report["plans"] if r["status"] == "ok"]
    assert len(ok) == 2 and report["num_failed"] == 0
    problem = make_problem(model="tiny", hardware=report["hardware"], gpus=2, gpus_per_node=2, global_batch=4,
                           seq_len=report["seq_len"], precision=report["precision"])
    for r in ok:
        # Each row's prediction is the cost model's price of that row's plan (recomputed here) ...
        priced = estimate(Plan.from_dict(r["plan"]), model=problem.model, cluster=problem.cluster, job=problem.job)
        assert r["predicted_step_time_s"] == pytest.approx(priced.step_time_s, rel=1e-9)
        assert r["predicted_peak_memory_bytes"] == priced.peak_memory_bytes
        # ... and its measured step time (two interleaved rounds of 3 timed steps in the batched run) agrees
        # with the plan's own training run, a separate measurement, within the noise of a shared host.
        assert len(r["batched_step_times_s"]) == 6 and all(t > 0 for t in r["batched_step_times_s"])
        own_run = statistics.median(r["rounds_step_time_s"])
        assert own_run / 4 < r["measured_step_time_s"] < own_run * 4, (r["measured_step_time_s"], own_run)
        assert r["measured_peak_memory_bytes"] > 100 * 2**20
    assert report["kendall_tau"] is not None and report["regret"] >= 0
    assert png.read_bytes()[:4] == b"\x89PNG"

    # Calibrate one parameter on the plans not held out; the profile it writes prices the plans closer.
    # compute_time_scale can move either way (op_overhead_s cannot go below 0, so it cannot help a plan
    # the preset already prices too slow).
    calibrated = tmp_path / "cal.json"
    result = runner.invoke(app, ["calibrate", "--measurements", str(report_path), "--out", str(calibrated),
                                 "--parameters", "compute_time_scale", "--format", "json"])
    assert result.exit_code == 0, result.output
    fit = json.loads(result.stdout)
    assert fit["fit_after"]["mape"] < fit["fit_before"]["mape"]
    hw = resolve_hardware(str(calibrated))
    assert hw.calibration["compute_time_scale"] != 1.0 and hw.calibration["framework_reserve_bytes"] > 0
    assert hw.calibrated_from_runs == len(fit["fit_labels"])
    # It keeps the runs it was fitted from, as measured: the host's speed reference for later validates
    # (against these very rows the host is exactly as fast).
    assert sorted(r.step_time_s for r in hw.calibration_runs) == sorted(r["measured_step_time_s"] for r in ok)
    from planner.reports import ValidationReport
    from planner.validate import Measurement, PlanEntry, ValidateSettings, host_speed_ratios

    rows = ValidationReport.from_dict(report).plans
    again = [Measurement(PlanEntry(r.label, r.source, r.plan), step_times_s=[r.measured_step_time_s])
             for r in rows if r.ok]
    settings = ValidateSettings(model="tiny", hardware=str(calibrated), nproc=2, global_batch=4,
                                seq_len=report["seq_len"], precision=report["precision"])
    assert [ratio for _, ratio in host_speed_ratios(again, settings)] == pytest.approx([1.0] * len(ok))

    # A preset cannot be overwritten in place.
    result = runner.invoke(app, ["calibrate", "--measurements", str(report_path), "--hardware", "cpu"])
    assert result.exit_code == 2 and "is a preset; give --out" in result.output
    # The report was priced on this machine's cached profile (the default), which calibrate writes into.
    assert report["hardware"].endswith("-n2.json") and resolve_hardware(report["hardware"]).measured_processes == 2

    # Explain a plan that ran, with its measured metrics beside the prediction.
    metrics = tmp_path / "m.json"
    result = runner.invoke(app, ["run", "--nproc", "2", "--global-batch", "4", "--steps", "3", "--pp", "2",
                                 "--metrics-out", str(metrics), "--format", "json"])
    assert result.exit_code == 0, result.output
    step_png = tmp_path / "step.png"
    # The metrics file holds a bare plan: the model comes from its flag (a plan file from search carries it).
    result = runner.invoke(app, ["explain", "--plan", str(metrics), "--model", "tiny", "--hardware", str(calibrated),
                                 "--seq-len", "64", "--measured", str(metrics), "--png", str(step_png)])
    assert result.exit_code == 0, result.output
    assert "measured step" in result.output and "pipeline rank 1" in result.output
    assert step_png.read_bytes()[:4] == b"\x89PNG"
    # The same metrics against another plan are refused by field.
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"dp": 2, "num_micro_batches": 2}))
    result = runner.invoke(app, ["explain", "--plan", str(other), "--model", "tiny", "--hardware", str(calibrated),
                                 "--seq-len", "64", "--measured", str(metrics)])
    assert result.exit_code == 2 and "is for another plan" in result.output
