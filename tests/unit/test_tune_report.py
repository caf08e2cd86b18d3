"""tune's host check and report warnings, on a fake batched timing: which calibration plans it re-times, the
host speed it takes from them, and the ratios and lines the report derives."""

from __future__ import annotations

import dataclasses

import pytest

from cost_models.estimate import estimate
from planner import tune as tune_module
from planner import validate as validate_module
from planner.reports import HostCheck, TuneCalibration, TuneReport
from planner.tune import TuneSettings, host_check, report_lines
from runners.config import RunSummary
from specs.hardware import CalibrationRun, resolve_hardware
from specs.plan import Plan
from specs.problem import make_problem

SETTINGS = TuneSettings(nproc=2, precision="fp32")
WINNER = Plan(dp=2, micro_batch=4, num_micro_batches=1)
FAST, SLOW, FAR = (Plan(dp=2, micro_batch=2, num_micro_batches=2), Plan(dp=2, micro_batch=1, num_micro_batches=4),
                   Plan(dp=1, tp=2, micro_batch=1, num_micro_batches=8))


def _predicted(profile: str, plan: Plan) -> float:
    problem = make_problem(model="tiny", hardware=profile, gpus=2, gpus_per_node=2, global_batch=8, seq_len=64,
                           precision="fp32")
    return estimate(plan, model=problem.model, cluster=problem.cluster, job=problem.job).step_time_s


def _profile(tmp_path, runs: list[tuple[Plan, float, int]]) -> str:
    """The cpu preset with calibration runs (plan, measured step time, global batch) at SETTINGS' job."""
    path = str(tmp_path / "profile.json")
    calibration_runs = tuple(CalibrationRun(model="tiny", plan=p.to_dict(), global_batch=batch, seq_len=64,
                                            precision="fp32", processes=2, step_time_s=t) for p, t, batch in runs)
    dataclasses.replace(resolve_hardware("cpu"), calibration_runs=calibration_runs).save(path)
    return path


def test_host_check_retimes_the_closest_other_calibration_plans_beside_the_winner(tmp_path, monkeypatch):
    probe = str(tmp_path / "probe.json")
    resolve_hardware("cpu").save(probe)
    predicted = _predicted(probe, WINNER)
    # The winner's own run and another batch's run are no reference; FAR is the farthest from the winner's
    # predicted time, so the two closest (FAST, SLOW) are re-timed.
    profile = _profile(tmp_path, [(WINNER, predicted, 8), (FAST, predicted * 1.1, 8), (SLOW, predicted * 0.8, 8),
                                  (FAR, predicted * 30, 8), (FAST, predicted, 16)])
    timed = []

    def fake_timing(entries, settings, *, rounds, steps_per_round, progress=None):
        timed.append([e.plan for e in entries])
        assert settings.global_batch == 8 and settings.nproc == 2 and rounds >= 2
        # Now the host runs the references 1.2x and 1.5x slower than at calibration; the winner takes 1.3x.
        now = {WINNER: predicted * 1.3, FAST: predicted * 1.1 * 1.2, SLOW: predicted * 0.8 * 1.5}
        return [[now[e.plan]] * (rounds * steps_per_round) for e in entries]

    monkeypatch.setattr(validate_module, "measure_step_times_batched", fake_timing)
    monkeypatch.setattr(tune_module, "HOST_CHECK_PLANS", 2)
    check = host_check(WINNER, predicted, profile, SETTINGS)
    assert timed == [[WINNER, FAST, SLOW]]
    assert check.reference_ratios == pytest.approx((1.2, 1.5)) and check.factor == pytest.approx(1.35)
    assert check.winner_step_time_s == pytest.approx(predicted * 1.3)
    assert check.references == (FAST.describe(), SLOW.describe())


def test_host_check_is_none_without_another_calibration_plan_at_these_settings(tmp_path, monkeypatch):
    monkeypatch.setattr(validate_module, "measure_step_times_batched", lambda *a, **k: pytest.fail("timed"))
    assert host_check(WINNER, 0.1, _profile(tmp_path, []), SETTINGS) is None
    assert host_check(WINNER, 0.1, _profile(tmp_path, [(WINNER, 0.1, 8), (FAST, 0.1, 16)]), SETTINGS) is None


def _report(**changes) -> TuneReport:
    summary = RunSummary(median_step_time_s=0.08, tokens_per_s=1.0, peak_memory_bytes=100 << 20, comm_bytes={},
                         comm_wait_s=0.0, world_size=2, device="cpu", engine="ours")
    fields = dict(profile="p.json", profile_reused=False, calibrated_from_runs=12, calibration=None, plan=WINNER,
                  runner_up=(), predicted={"step_time_s": 0.1, "peak_memory_bytes": 100 << 20}, measured=summary,
                  losses=(5.0, 4.9), times_s={"profile": 1.0, "calibrate": 1.0, "search": 0.1, "run": 1.0, "total": 3.1})
    return TuneReport(**{**fields, **changes})


def test_the_report_gives_measured_over_predicted_at_the_host_speed_and_says_so():
    """The headline ratio is at the host's speed now where the host check measured it (the winner beside
    calibration plans in one window), with the run's own ratio at the profile's speed beside it."""
    plain = _report()
    assert plain.step_time_ratio == pytest.approx(0.8) and plain.step_time_ratio_at_host_speed is None
    assert plain.step_time_ratio_at_profile_speed == pytest.approx(0.8)
    assert [line for line in report_lines(plain) if line.startswith("step time")] == [
        "step time: its own run measured 80.0 ms against 100.0 ms predicted at the profile's speed "
        "(measured / predicted 0.80)"]
    checked = _report(host_check=HostCheck(factor=0.75, winner_step_time_s=0.078, references=("a", "b"),
                                           reference_ratios=(0.7, 0.8)))
    # Predicted 100 ms at calibration speed is 75 ms at the host's speed now; measured 78 ms beside it.
    assert checked.step_time_ratio_at_host_speed == pytest.approx(0.078 / 0.075)
    assert checked.step_time_ratio == pytest.approx(1.04)
    assert checked.step_time_ratio_at_profile_speed == pytest.approx(0.8)
    data = checked.to_dict()
    assert data["step_time_ratio"] == pytest.approx(1.04)
    assert data["step_time_ratio_at_profile_speed"] == pytest.approx(0.8)
    lines = report_lines(checked)
    line = next(line for line in lines if line.startswith("step time"))
    assert "0.75x" in line and "measured 78.0 ms" in line and "predicted 75.0 ms" in line and "1.04" in line
    assert any("own run measured 80.0 ms" in line and "0.80" in line for line in lines)


def test_the_report_warns_when_the_fit_priced_compute_at_almost_nothing():
    def lines(share):
        calibration = TuneCalibration(num_plans=12, parameters={"compute_time_scale": 0.0002}, mape_before=0.2,
                                      mape_after=0.1, compute_scale_of_probe=share)
        return [line for line in report_lines(_report(calibration=calibration)) if "priced compute" in line]

    assert lines(0.0002 / 2.2) and "larger model" in lines(0.0002 / 2.2)[0]
    assert not lines(0.5) and not lines(None)


def test_tune_settings_run_the_host_check_by_default():
    assert TuneSettings().host_check and tune_module.HOST_CHECK_PLANS >= 1


def test_a_failed_host_check_leaves_the_run_and_its_report_standing(tmp_path, monkeypatch):
    """The host check runs after the training run: if it fails, tune still returns the run's report and
    says why the check is missing, instead of losing the run to the check's error."""
    import runners.launch as launch_module
    from runners.config import RunMetrics, StepRecord
    from runners.launch import RunFailed

    profile = str(tmp_path / "profile.json")
    dataclasses.replace(resolve_hardware("cpu"), calibrated_from_runs=1).save(profile)
    summary = RunSummary(median_step_time_s=0.05, tokens_per_s=1.0, peak_memory_bytes=100 << 20, comm_bytes={},
                         comm_wait_s=0.0, world_size=2, device="cpu", engine="ours")

    def fake_launch(cfg, *, where, on_step=None):
        steps = tuple(StepRecord(step=i, loss=5.0 - 0.1 * i, step_time_s=0.05) for i in range(cfg.steps))
        return RunMetrics(plan=cfg.plan, steps=steps, summary=summary)

    def failing_check(*args, **kwargs):
        raise RunFailed("rank 1 exited with SIGABRT\nmore lines")

    monkeypatch.setattr(launch_module, "launch", fake_launch)
    monkeypatch.setattr(tune_module, "host_check", failing_check)
    report = tune_module.tune(TuneSettings(nproc=2, steps=3, profile=profile))
    assert report.losses == pytest.approx((5.0, 4.9, 4.8)) and report.host_check is None
    assert report.host_check_error == "rank 1 exited with SIGABRT"
    assert report.step_time_ratio_at_host_speed is None and report.to_dict()["host_check_error"]
    assert any(line.startswith("host check failed") and "SIGABRT" in line for line in report_lines(report))
