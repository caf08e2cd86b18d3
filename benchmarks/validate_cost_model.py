"""How well the cost model predicts real runs, before and after calibration, against the targets.

    python benchmarks/validate_cost_model.py --nproc 4 --out-dir out/validate
    python benchmarks/validate_cost_model.py --profile p.json --measurements out/validate/measured.json   # re-score only

1. profile this node (`planner profile --quick`), unless --profile is given;
2. measure the search's top plans and the spread (planner/validate.py) with --rounds interleaved runs each
   (memory, and which plans run), unless --measurements is given (a `planner validate` report); then
   time them in one batched run of --timing-rounds interleaved rounds (unless the report has those);
3. calibrate on half of the plans (planner/calibrate.py) and score the other half;
4. search again with the calibrated profile and measure its winner if it was not measured yet; then time
   the winner and the --confirm-plans fastest measured plans side by side (--confirm-rounds interleaved
   rounds in one launch): the regret of the top pick is its step time over the fastest of them;
5. issue 4's check: DP and ZeRO plans (tp = pp = 1) priced with the profile alone (and, for comparison,
   the calibrated one) against their measured median step time.

Targets: on >= 24 plans, held-out MAPE <= 10%, held-out Kendall tau >= 0.8, regret <= 5%, DP/ZeRO
plans within 20%. Prints one line per target and writes summary.json and before/after scatters.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from planner.calibrate import calibrate, ok_rows  # noqa: E402
from planner.reports import Agreement, ValidationReport  # noqa: E402
from specs.jsonio import read_json_file, write_json_atomic  # noqa: E402
from planner.validate import (Measurement, PlanEntry, ValidateSettings, build_report, measure,  # noqa: E402
                              measure_step_times_batched, plan_key, repredict, validate, write_scatter_png)
from specs.hardware import with_calibration  # noqa: E402

TARGETS = {"num_plans": 24, "held_out_mape": 0.10, "held_out_kendall_tau": 0.8, "regret": 0.05, "dp_zero_max_error": 0.20}


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def agreement(rows) -> dict:
    return Agreement.of(list(rows)).to_dict()


def retime(report: ValidationReport, settings: ValidateSettings) -> ValidationReport:
    """The report with its plans that ran timed again in one batched interleaved run."""

    ok = [r for r in report.plans if r.ok]
    entries = [PlanEntry(r.label, r.source, r.plan) for r in ok]
    log(f"batched timing of {len(entries)} plans: {settings.timing_rounds} rounds of {settings.timing_steps} steps")
    times = measure_step_times_batched(entries, settings, rounds=settings.timing_rounds,
                                       steps_per_round=settings.timing_steps,
                                       progress=lambda d, n, label: log(f"  {d}/{n}: {label}") if d % 10 == 0 else None)
    measurements = []
    for r in report.plans:
        m = Measurement(PlanEntry(r.label, r.source, r.plan), error=r.error, step_times_s=list(r.rounds_step_time_s),
                        peak_memory_bytes=[r.measured_peak_memory_bytes] if r.measured_peak_memory_bytes else [])
        if r.ok:
            m.batched_step_times_s = list(times[ok.index(r)])
        measurements.append(m)
    return build_report(measurements, settings)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--timing-rounds", type=int, default=6)
    parser.add_argument("--timing-steps", type=int, default=3)
    parser.add_argument("--top", type=int, default=3)
    parser.add_argument("--confirm-rounds", type=int, default=10,
                        help="Rounds of the side-by-side timing of the pick and the fastest plans (0: skip).")
    parser.add_argument("--confirm-plans", type=int, default=3, help="Fastest measured plans timed beside the pick.")
    parser.add_argument("--profile", help="Use this profile instead of measuring one.")
    parser.add_argument("--measurements", help="Re-score a `planner validate` report instead of measuring.")
    parser.add_argument("--out-dir", default="out/validate")
    args = parser.parse_args()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)

    profile = args.profile
    if profile is None:
        from planner.profiling import measure_profile
        from profilers.profile import ProfileOptions

        log(f"profiling {args.nproc} processes (quick)")
        profile = str(out / "profile.json")
        measure_profile(ProfileOptions(nproc=args.nproc, quick=True)).save(profile)
    settings = ValidateSettings(hardware=profile, nproc=args.nproc, global_batch=args.global_batch, seq_len=args.seq_len,
                                steps=args.steps, rounds=args.rounds, top_k=args.top,
                                timing_rounds=args.timing_rounds, timing_steps=args.timing_steps)
    if args.measurements:
        report = ValidationReport.from_dict(read_json_file(args.measurements, what="measurements"))
        if args.timing_rounds and not any(r.batched_step_times_s for r in report.plans):
            report = retime(report, settings)
            write_json_atomic(out / "measured.json", report.to_dict())
    else:
        log(f"measuring plans: {args.rounds} interleaved rounds of {args.steps} steps")
        report = validate(settings, progress=lambda d, n, label: log(f"  run {d}/{n}: {label}"))
        write_json_atomic(out / "measured.json", report.to_dict())
    problem = settings.problem()
    rows = repredict(list(report.plans), problem)
    datasheet = repredict(list(report.plans), dataclasses.replace(settings, hardware="cpu").problem())
    log(f"{len(rows)} plans, {len(ok_rows(rows))} ran")

    result = calibrate(rows, problem)
    calibrated_hw = with_calibration(problem.cluster.hardware, result.calibration)
    calibrated_path = out / "profile-calibrated.json"
    calibrated_hw.save(calibrated_path)
    calibrated = dataclasses.replace(settings, hardware=str(calibrated_path))
    after = repredict(rows, calibrated.problem())

    # The calibrated search's winner, measured if it is new, against the best measured plan.
    from planner.search import SearchOptions, search

    winner = search(calibrated.problem(), options=SearchOptions(top_k=3)).winner.plan
    measured = {plan_key(r.plan.to_dict()): r for r in after}
    key = plan_key(winner.to_dict())
    if key not in measured or not measured[key].ok:
        log(f"measuring the calibrated search's winner {winner.describe()}")
        new = measure([PlanEntry("calibrated search #1", "search", winner)], calibrated)
        extra = list(build_report(new, calibrated).plans)
        after += extra
        measured[key] = extra[0]
    top = measured[key]
    best = min(ok_rows(after), key=lambda r: r.measured_step_time_s)
    first_regret = (top.measured_step_time_s / best.measured_step_time_s - 1.0) if top.ok else None
    # Confirmation: the pick and the fastest measured plans, timed again side by side in one batched
    # interleaved run of --confirm-rounds rounds. The first pass samples 28 plans a few steps each, so
    # the ranking of plans within a few percent of each other is noise; regret compares the contenders.
    regret, confirmed = first_regret, {}
    if top.ok and args.confirm_rounds:
        contenders = [winner] + [r.plan for r in sorted(ok_rows(after), key=lambda r: r.measured_step_time_s)]
        unique = list(dict.fromkeys(contenders))[:1 + args.confirm_plans]
        log(f"confirming: {len(unique)} plans, {args.confirm_rounds} interleaved rounds")
        times = measure_step_times_batched([PlanEntry(p.describe(), "confirm", p) for p in unique], calibrated,
                                           rounds=args.confirm_rounds, steps_per_round=settings.timing_steps)
        confirmed = {p.describe(): statistics.median(t) for p, t in zip(unique, times)}
        regret = confirmed[winner.describe()] / min(confirmed.values()) - 1.0
        for name, t in sorted(confirmed.items(), key=lambda kv: kv[1]):
            log(f"  {name:<44} {t * 1e3:8.1f} ms{'   <- calibrated pick' if name == winner.describe() else ''}")

    # Issue 4's check is about the profile alone; the calibrated figure is reported beside it.
    dp_zero_profile = [r for r in ok_rows(rows) if r.plan.tp == 1 and r.plan.pp == 1]
    dp_zero_within = sum(abs(r.step_time_error) <= TARGETS["dp_zero_max_error"] for r in dp_zero_profile)
    dp_zero = [r for r in ok_rows(after) if r.plan.tp == 1 and r.plan.pp == 1]
    dp_zero_max = max((abs(r.step_time_error) for r in dp_zero), default=None)

    summary = {
        "num_plans": len(report.plans), "num_failed": report.num_failed,
        "failed": {r.label: r.error for r in rows if not r.ok},
        "datasheet_cpu_all": agreement(datasheet), "profile_all": agreement(rows),
        "calibration": result.calibration, "fit_labels": result.fit_labels, "held_out_labels": result.held_out_labels,
        "held_out_before": result.held_out_before.to_dict(), "held_out_after": result.held_out_after.to_dict(),
        "fit_after": result.fit_after.to_dict(), "calibrated_all": agreement(after),
        "calibrated_search_winner": winner.describe(), "winner_measured_step_time_s": top.measured_step_time_s,
        "best_measured": best.label, "best_measured_step_time_s": best.measured_step_time_s,
        "first_pass_regret": first_regret, "confirmed_step_times_s": confirmed, "regret": regret,
        "dp_zero_errors": {r.label: r.step_time_error for r in dp_zero}, "dp_zero_max_error": dp_zero_max,
        "dp_zero_profile_errors": {r.label: r.step_time_error for r in dp_zero_profile},
        "dp_zero_profile_within": dp_zero_within,
    }
    write_json_atomic(out / "summary.json", summary)
    # Fitted to these very runs, the calibrated profile is at their speed: no host-speed scaling on it.
    calibrated_report = dataclasses.replace(report, plans=tuple(after), hardware=str(calibrated_path),
                                            hardware_name="calibrated profile", host_speed_factor=None,
                                            host_speed_plans=0, host_speed_ratios=())
    write_json_atomic(out / "calibrated.json", calibrated_report.to_dict())
    write_scatter_png(dataclasses.replace(report, plans=tuple(rows)), str(out / "scatter-profile.png"),
                      title="uncalibrated quick profile")
    write_scatter_png(calibrated_report, str(out / "scatter-calibrated.png"),
                      title="calibrated profile (all plans; see summary for held-out)")

    def pct(v):
        return "n/a" if v is None else f"{v:.1%}"

    for name, stats in (("datasheet cpu preset, all plans", summary["datasheet_cpu_all"]),
                        ("quick profile, all plans", summary["profile_all"]),
                        ("held out, before calibration", summary["held_out_before"]),
                        ("held out, after calibration", summary["held_out_after"]),
                        ("calibrated, all plans", summary["calibrated_all"])):
        tau = stats["kendall_tau"]
        log(f"{name:<34} n={stats['num_ok']:<3} MAPE {pct(stats['mape']):>7}  max {pct(stats['max_error']):>7}  "
            f"tau {'n/a' if tau is None else f'{tau:.3f}'}  memory MAPE {pct(stats['memory_mape'])}")
    log("calibration: " + ", ".join(f"{k}={v:.4g}" for k, v in result.calibration.items()))
    checks = [
        ("plans measured", len(report.plans), f">= {TARGETS['num_plans']}", len(report.plans) >= TARGETS["num_plans"]),
        ("held-out MAPE", pct(result.held_out_after.mape), "<= 10%",
         result.held_out_after.mape is not None and result.held_out_after.mape <= TARGETS["held_out_mape"]),
        ("held-out Kendall tau", result.held_out_after.kendall_tau, ">= 0.8",
         (result.held_out_after.kendall_tau or -1) >= TARGETS["held_out_kendall_tau"]),
        ("regret of the calibrated search's pick (confirmed)",
         f"{pct(regret)} ({winner.describe()}; first pass {pct(first_regret)} vs {best.label})", "<= 5%",
         regret is not None and regret <= TARGETS["regret"]),
        ("DP/ZeRO plans within 20% with the profile alone (issue 4)", f"{dp_zero_within} of {len(dp_zero_profile)} "
         f"(calibrated: max |error| {pct(dp_zero_max)})", "all", dp_zero_within == len(dp_zero_profile)),
    ]
    for name, value, target, ok in checks:
        log(f"{'PASS' if ok else 'FAIL'}  {name}: {value} (target {target})")
    log(f"wrote {out}/summary.json, measured.json, calibrated.json, profile-calibrated.json, scatter-*.png")
    return 0 if all(ok for *_, ok in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
