"""planner validate's library: plan selection, agreement metrics, failure handling, the report and PNG."""

from __future__ import annotations

import itertools
import json

from types import SimpleNamespace

import pytest

from specs.errors import PlannerError
from cost_models.estimate import estimate
from planner.reports import Agreement, ValidationReport, ValidationRow, kendall_tau
from planner.validate import (MAX_TIMING_ROUNDS, TIMING_ROUNDS_PER_LAUNCH, ValidateSettings, build_report,
                             candidate_plans, measure, write_scatter_png)
from specs.hardware import PRESETS
from specs.plan import Plan
from runners.launch import RunFailed


def _saved(hardware, directory) -> str:
    """`hardware` written as a profile file in `directory`, for settings that name one."""
    path = str(directory / "profile.json")
    hardware.save(path)
    return path


def _brute_tau_b(x, y):
    pairs = list(itertools.combinations(range(len(x)), 2))
    num = sum(((x[i] > x[j]) - (x[i] < x[j])) * ((y[i] > y[j]) - (y[i] < y[j])) for i, j in pairs)
    n0 = len(pairs)
    tx = sum(x[i] == x[j] for i, j in pairs)
    ty = sum(y[i] == y[j] for i, j in pairs)
    return num / ((n0 - tx) * (n0 - ty)) ** 0.5


def test_kendall_tau_known_values_and_ties():
    assert kendall_tau([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert kendall_tau([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # One swapped pair of 6: (5 - 1) / 6.
    assert kendall_tau([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(4 / 6)
    for x, y in (([1, 1, 2, 3], [1, 2, 2, 5]), ([3, 1, 2, 2, 5], [1, 1, 4, 2, 3])):
        assert kendall_tau(x, y) == pytest.approx(_brute_tau_b(x, y))
    assert kendall_tau([1], [2]) is None and kendall_tau([1, 1], [2, 3]) is None


def _row(label, predicted, measured, *, status="ok"):
    return ValidationRow(label=label, source="spread", plan=Plan(), status=status, error=None,
                         predicted_step_time_s=predicted, predicted_peak_memory_bytes=100,
                         measured_step_time_s=measured if status == "ok" else None,
                         measured_peak_memory_bytes=110 if status == "ok" else None)


def test_agreement_by_hand():
    rows = [_row("a", 1.0, 1.25), _row("b", 2.0, 1.0), _row("c", 3.0, 3.0), _row("d", 0.1, 9.0, status="failed")]
    got = Agreement.of(rows)
    assert got.num_ok == 3
    assert got.mape == pytest.approx((0.2 + 1.0 + 0.0) / 3)
    assert got.max_error == pytest.approx(1.0)
    # The model's pick is a (1.0 predicted), measured 1.25 against b's 1.0 best: 25% regret.
    assert got.top_pick == "a" and got.best_measured == "b" and got.regret == pytest.approx(0.25)
    assert got.kendall_tau == pytest.approx(1 / 3)
    assert got.memory_mape == pytest.approx(10 / 110)
    assert Agreement.of([]).mape is None
    # The JSON form round-trips, derived fields included for readers and ignored on the way back.
    assert ValidationRow.from_dict(rows[0].to_dict()) == rows[0] and rows[0].to_dict()["step_time_error"] == -0.2
    # So does a whole report, as `planner calibrate --measurements` reads `planner validate --out`.
    report = ValidationReport(model="tiny", hardware="cpu", hardware_name="cpu", calibration={}, nproc=4, cluster=None,
                              global_batch=16, seq_len=64, precision="fp32", steps=4, rounds=1, timing_rounds=0,
                              plans=tuple(rows))
    assert ValidationReport.from_dict(json.loads(json.dumps(report.to_dict()))) == report


def test_candidates_span_the_knobs_without_duplicates():
    problem = ValidateSettings(nproc=4).problem()
    entries = candidate_plans(problem, top_k=2)
    plans = [e.plan for e in entries]
    assert len(set(plans)) == len(plans) >= 24
    assert [e.source for e in entries[:2]] == ["search", "search"]
    assert {p.zero_level for p in plans if p.dp == 4} >= {0, 1, 2, 3}
    assert {p.tp for p in plans} >= {1, 2, 4} and {p.pp for p in plans} >= {1, 2, 4}
    assert {p.micro_batch for p in plans} >= {1, 2, 4}
    assert {p.schedule for p in plans if p.pp > 1} >= {"1f1b", "gpipe", "interleaved-1f1b"}
    assert len(candidate_plans(problem, top_k=1, max_plans=3)) == 3
    with pytest.raises(PlannerError, match="no plan to validate"):
        candidate_plans(problem, top_k=0, spread=False)


def test_failed_run_is_reported_and_the_others_continue(tmp_path):
    settings = ValidateSettings(nproc=4, steps=3, rounds=2, top_k=0, max_plans=3, timing_rounds=0)
    calls = []

    def fake_runner(cfg, where):
        calls.append(cfg.plan)
        if cfg.plan.tp == 2:
            raise RunFailed("rank 1 failed: RuntimeError: boom")
        step = 0.1 * cfg.plan.pp + 0.01 * len(calls)
        return SimpleNamespace(summary=SimpleNamespace(median_step_time_s=step, peak_memory_bytes=300 * 2**20))

    report = build_report(measure(candidate_plans(settings.problem(), top_k=0, max_plans=3), settings,
                                  runner=fake_runner), settings)
    # The failed plan ran once (not retried in round 2); the other two ran twice.
    assert len(calls) == 5
    assert len(report.plans) == 3 and report.num_failed == 1 and report.agreement.num_ok == 2
    failed = [r for r in report.plans if r.status == "failed"]
    assert failed[0].label == "tp2" and "rank 1 failed" in failed[0].error
    dp = next(r for r in report.plans if r.label == "dp mb1")
    assert dp.rounds_step_time_s == pytest.approx((0.11, 0.14))
    assert dp.measured_step_time_s == pytest.approx(0.125)
    # The prediction is the cost model's for that plan on the settings' hardware, priced here independently.
    problem = settings.problem()
    predicted = estimate(dp.plan, model=problem.model, cluster=problem.cluster, job=problem.job).step_time_s
    assert dp.predicted_step_time_s == predicted and dp.step_time_error == pytest.approx(predicted / 0.125 - 1)
    png = tmp_path / "scatter.png"
    write_scatter_png(report, str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_settings_refuse_bad_values():
    with pytest.raises(PlannerError, match="--steps must be at least 2"):
        ValidateSettings(steps=1)
    with pytest.raises(PlannerError, match="--max-plans"):
        ValidateSettings(max_plans=0)


def test_timing_adds_interleaved_rounds_until_the_top_pick_and_the_fastest_are_separable():
    """The default timing (timing_rounds None) adds batched launches while the cost model's top pick and the
    fastest measured plan overlap in their interquartile ranges; regret counts only a separable gap."""
    settings = ValidateSettings(nproc=4, steps=3, top_k=0, max_plans=3)
    entries = candidate_plans(settings.problem(), top_k=0, max_plans=3)
    problem = settings.problem()
    predicted = [estimate(e.plan, model=problem.model, cluster=problem.cluster, job=problem.job).step_time_s
                 for e in entries]
    top = min(range(3), key=predicted.__getitem__)
    other = (top + 1) % 3
    launches = []

    def noisy_timer(batch, settings, *, rounds, steps_per_round, progress):
        launches.append(rounds)
        # The other plan is 2% faster than the top pick; each launch adds 1% noise on both, so their
        # quartile ranges keep overlapping: every launch up to the limit runs.
        out = []
        for i, _ in enumerate(batch):
            base = 0.098 if i == other else (0.100 if i == top else 0.2)
            out.append([base * (1 + 0.012 * ((k % 3) - 1)) for k in range(rounds * steps_per_round)])
        return out

    report = build_report(measure(entries, settings, runner=_fake_runner, timer=noisy_timer), settings)
    assert launches == [TIMING_ROUNDS_PER_LAUNCH] * (MAX_TIMING_ROUNDS // TIMING_ROUNDS_PER_LAUNCH)
    assert report.timing_rounds == MAX_TIMING_ROUNDS
    agree = report.agreement
    assert agree.top_pick_within_noise and agree.regret == 0.0 and agree.raw_regret == pytest.approx(0.1 / 0.098 - 1)

    launches.clear()

    def clean_timer(batch, settings, *, rounds, steps_per_round, progress):
        launches.append(rounds)
        return [[0.098 if i == other else (0.100 if i == top else 0.2)] * (rounds * steps_per_round)
                for i, _ in enumerate(batch)]

    report = build_report(measure(entries, settings, runner=_fake_runner, timer=clean_timer), settings)
    assert launches == [TIMING_ROUNDS_PER_LAUNCH]  # separable after the first launch: no more rounds
    assert not report.agreement.top_pick_within_noise
    assert report.agreement.regret == pytest.approx(0.1 / 0.098 - 1)


def _fake_runner(cfg, where):
    return SimpleNamespace(summary=SimpleNamespace(median_step_time_s=0.1, peak_memory_bytes=300 * 2**20))


def test_the_spread_holds_legal_context_parallel_plans():
    """CP in the spread: dp2 x cp2 (ring and all-to-all) and cp4 on 4 processes, cp2 on 2, each a plan the
    problem holds (the sequence splits into 2 x cp chunks; all-to-all divides the K/V heads)."""
    from specs.plan import check_plan

    for nproc, expected in ((4, {"cp2": (2, 2, "ring"), "cp4": (1, 4, "ring"), "cp2 a2a": (2, 2, "all-to-all")}),
                            (2, {"cp2": (1, 2, "ring"), "cp2 a2a": (1, 2, "all-to-all")})):
        problem = ValidateSettings(nproc=nproc, hardware="cpu").problem()
        entries = {e.label: e.plan for e in candidate_plans(problem, top_k=0) if e.plan.cp > 1}
        assert {label: (p.dp, p.cp, p.cp_kind) for label, p in entries.items()} == expected
        for plan in entries.values():
            check_plan(plan, model=problem.model, num_devices=nproc, job=problem.job)


def test_the_batched_timing_freezes_what_is_alive_after_a_trainers_first_step():
    """runners.timing keeps many trainers in one process; their objects are frozen out of the cyclic
    collector's traversals (`_freeze_long_lived`) so that a plan's step does not grow with the plans beside it."""
    import gc

    from runners.timing import _freeze_long_lived

    kept = [[object()] for _ in range(1000)]  # noqa: F841 - alive across the freeze
    before = gc.get_freeze_count()
    try:
        _freeze_long_lived()
        assert gc.get_freeze_count() >= before + 1000
    finally:
        gc.unfreeze()


def test_host_speed_compares_the_plans_the_calibration_timed_and_rescales_the_mape(tmp_path):
    """planner/validate.host_speed_ratios: measured now / then of every validated plan the profile's calibration
    timed at the same model, batch, sequence, precision and process count (other runs do not match) and of
    every reference timed beside them; the headline MAPE takes each prediction at the others' median."""
    import dataclasses

    from planner.validate import Measurement, PlanEntry, ValidateSettings, host_speed_ratios
    from specs.hardware import CalibrationRun

    a, b, c = Plan(micro_batch=1, num_micro_batches=8), Plan(micro_batch=2, num_micro_batches=4), Plan(micro_batch=4, num_micro_batches=2)

    def run(plan, seconds, **changes):
        fields = dict(model="tiny", plan=plan.to_dict(), global_batch=8, seq_len=64, precision="fp32", processes=2,
                      step_time_s=seconds)
        return CalibrationRun(**{**fields, **changes})

    profile = dataclasses.replace(PRESETS["cpu"], calibration_runs=(
        run(a, 0.10), run(b, 0.20), run(c, 0.05, global_batch=16), run(c, 0.05, processes=4), run(c, 0.05, model="gpt2")))
    profile = type(profile).from_dict(json.loads(json.dumps(profile.to_dict())))  # the runs survive the JSON
    settings = ValidateSettings(model="tiny", hardware="cpu", nproc=2, global_batch=8, seq_len=64, precision="fp32")
    settings = dataclasses.replace(settings, hardware=_saved(profile, tmp_path))
    reference = PlanEntry("reference 1 (tiny, batch 16)", "reference", c, reference=profile.calibration_runs[2])
    measured = [Measurement(PlanEntry("a", "spread", a), step_times_s=[0.12]),
                Measurement(PlanEntry("b", "spread", b), step_times_s=[0.30], batched_step_times_s=[0.26]),
                Measurement(PlanEntry("c", "spread", c), step_times_s=[0.09]),  # the batch-16 run is not c's here
                Measurement(PlanEntry("x", "spread", a), error="died"),
                Measurement(reference, batched_step_times_s=[0.07, 0.08, 0.07])]
    ratios = host_speed_ratios(measured, settings)
    assert dict(ratios) == pytest.approx({"a": 1.2, "b": 1.3, "reference 1 (tiny, batch 16)": 1.4})
    rows = [dataclasses.replace(_row("a", 0.10, 0.12), plan=a), dataclasses.replace(_row("b", 0.20, 0.26), plan=b),
            dataclasses.replace(_row("c", 0.05, 0.09), plan=c), dataclasses.replace(_row("x", 0.1, None, status="failed"), plan=a)]
    report = ValidationReport(model="tiny", hardware="p.json", hardware_name="cpu", calibration={}, nproc=2, cluster=None,
                              global_batch=8, seq_len=64, precision="fp32", steps=8, rounds=1, timing_rounds=4,
                              plans=tuple(rows), host_speed_factor=1.3, host_speed_plans=3, host_speed_ratios=ratios)
    # a's prediction at the median of b and the reference (1.35), b's at a and the reference's (1.3), c's at all (1.3).
    assert [report.host_speed_for(r) for r in rows[:3]] == pytest.approx([1.35, 1.3, 1.3])
    expected = (abs(0.10 * 1.35 / 0.12 - 1) + abs(0.20 * 1.3 / 0.26 - 1) + abs(0.05 * 1.3 / 0.09 - 1)) / 3
    raw = (abs(0.10 / 0.12 - 1) + abs(0.20 / 0.26 - 1) + abs(0.05 / 0.09 - 1)) / 3
    assert report.agreement.mape == pytest.approx(expected)
    assert report.agreement_at_profile_speed.mape == pytest.approx(raw)
    # The ranking is the cost model's own, whatever the speed.
    assert report.agreement.kendall_tau == report.agreement_at_profile_speed.kendall_tau
    assert report.agreement.top_pick == report.agreement_at_profile_speed.top_pick == "c"
    data = report.to_dict()
    assert data["mape"] == pytest.approx(expected) and data["mape_at_profile_speed"] == pytest.approx(raw)
    assert data["predictions_at_host_speed"] and data["plans"][0]["predicted_at_host_speed_s"] == pytest.approx(0.135)
    assert ValidationReport.from_dict(json.loads(json.dumps(data))) == report
    # One reference is too few: a reference's own prediction would have no other to take its speed from.
    one = dataclasses.replace(report, host_speed_ratios=ratios[:1], host_speed_plans=1)
    assert not one.at_host_speed and one.agreement.mape == pytest.approx(raw)
    assert host_speed_ratios(measured, dataclasses.replace(settings, precision="bf16")) == (
        ("reference 1 (tiny, batch 16)", pytest.approx(1.4)),)


def test_validate_times_the_calibrations_other_plans_as_references_beside_the_validated_ones(tmp_path):
    """planner/validate.reference_entries: the calibration's plans at this process count that the validation
    does not time at its own settings, each at its own model and batch, up to HOST_REFERENCE_PLANS in all."""
    import dataclasses

    from planner import validate as validate_module
    from planner.validate import PlanEntry, ValidateSettings, reference_entries
    from specs.hardware import CalibrationRun

    a, b, c = (Plan(micro_batch=1, num_micro_batches=8), Plan(micro_batch=2, num_micro_batches=4),
               Plan(micro_batch=4, num_micro_batches=2))

    def run(plan, batch, processes=2, model="tiny"):
        return CalibrationRun(model=model, plan=plan.to_dict(), global_batch=batch, seq_len=64, precision="fp32",
                              processes=processes, step_time_s=0.1)

    runs = (run(a, 8), run(b, 8), run(c, 16), run(c, 8, processes=4), run(a, 8, model="no-such-model"))
    profile = _saved(dataclasses.replace(PRESETS["cpu"], calibration_runs=runs), tmp_path)
    settings = ValidateSettings(model="tiny", hardware=profile, nproc=2, global_batch=8, seq_len=64, precision="fp32")
    refs = reference_entries([PlanEntry("a", "spread", a)], settings)
    assert [(e.plan, e.problem.job.global_batch, e.reference) for e in refs] == [(b, 8, runs[1]), (c, 16, runs[2])]
    assert all(e.source == "reference" for e in refs) and refs[1].label == "reference 2 (tiny, batch 16)"
    original = validate_module.HOST_REFERENCE_PLANS
    try:
        validate_module.HOST_REFERENCE_PLANS = 2  # a (validated) and one more
        assert [e.plan for e in reference_entries([PlanEntry("a", "spread", a)], settings)] == [b]
    finally:
        validate_module.HOST_REFERENCE_PLANS = original


def test_validate_takes_its_predictions_at_the_host_speed_its_references_measured_beside_the_plans(tmp_path):
    """validate() times the calibration's other plans in the same batched run as the validated ones (they
    are not rows), and the headline MAPE takes the predictions at the host's speed they measured: here the
    host runs every plan 1.5x slower than the profile prices it, which the MAPE at the profile's speed shows
    and the headline does not."""
    import dataclasses

    from planner.validate import validate
    from specs.hardware import CalibrationRun

    base = ValidateSettings(nproc=2, steps=3, top_k=0, max_plans=2, timing_rounds=2, global_batch=8, seq_len=64,
                            precision="fp32", hardware="cpu")
    problem = base.problem()
    others = [Plan(dp=2, micro_batch=2, num_micro_batches=1), Plan(dp=2, micro_batch=1, num_micro_batches=2)]

    def price(plan, job):
        return estimate(plan, model=problem.model, cluster=problem.cluster, job=job).step_time_s

    then = [CalibrationRun(model="tiny", plan=p.to_dict(), global_batch=4, seq_len=64, precision="fp32", processes=2,
                           step_time_s=price(p, dataclasses.replace(problem.job, global_batch=4))) for p in others]
    settings = dataclasses.replace(base, hardware=_saved(dataclasses.replace(problem.cluster.hardware,
                                                                             calibration_runs=tuple(then)), tmp_path))
    timed = []

    def slow_host(batch, settings, *, rounds, steps_per_round, progress):
        timed.append([(e.label, e.source) for e in batch])
        return [[1.5 * price(e.plan, (e.problem or problem).job)] * (rounds * steps_per_round) for e in batch]

    report = validate(settings, runner=_fake_runner, timer=slow_host)
    assert [source for _, source in timed[0]] == ["spread", "spread", "reference", "reference"]
    assert [r.label for r in report.plans] == ["dp mb1", "tp2"] and report.at_host_speed
    assert report.host_speed_factor == pytest.approx(1.5) and report.host_speed_plans == 2
    assert report.agreement.mape == pytest.approx(0.0, abs=1e-9)
    assert report.agreement_at_profile_speed.mape == pytest.approx(1 / 3)


def test_a_reference_that_no_longer_runs_does_not_cost_the_validation(tmp_path):
    """A batched timing that fails with the calibration's references beside the plans is run again without
    them: the plans are measured, the predictions stay at the profile's speed, and a warning says why."""
    import dataclasses

    from planner.validate import validate
    from specs.hardware import CalibrationRun

    base = ValidateSettings(nproc=2, steps=3, top_k=0, max_plans=2, timing_rounds=2, global_batch=8, seq_len=64,
                            precision="fp32", hardware="cpu")
    runs = tuple(CalibrationRun(model="tiny", plan=Plan(dp=2, micro_batch=m, num_micro_batches=4 // (2 * m)).to_dict(),
                                global_batch=4, seq_len=64, precision="fp32", processes=2, step_time_s=0.1)
                 for m in (1, 2))
    settings = dataclasses.replace(base, hardware=_saved(dataclasses.replace(PRESETS["cpu"], calibration_runs=runs),
                                                         tmp_path))
    launches = []

    def timer(batch, settings, *, rounds, steps_per_round, progress):
        launches.append([e.source for e in batch])
        if any(e.source == "reference" for e in batch):
            raise RunFailed("rank 0 failed: a plan this version no longer runs")
        return [[0.1] * (rounds * steps_per_round) for _ in batch]

    with pytest.warns(UserWarning, match="timed without them"):
        report = validate(settings, runner=_fake_runner, timer=timer)
    assert launches == [["spread", "spread", "reference", "reference"], ["spread", "spread"]]
    assert report.agreement.num_ok == 2 and not report.at_host_speed and report.host_speed_plans == 0
    assert all(len(r.batched_step_times_s) == 6 for r in report.plans)
