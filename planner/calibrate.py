"""`planner calibrate`: fit the cost model's free parameters to measured runs, check them on runs held
out of the fit, and write them into the hardware profile so the next search uses them.

    planner validate --nproc 4 --hardware profile.json --out validate.json
    planner calibrate --measurements validate.json --hardware profile.json --out profile.json

    planner calibrate --from-runs runs.csv --hardware h100 --out h100-ours.json   # a GPU cluster's past runs

Free parameters (calibration keys, documented in cost_models/estimate.py):
  compute_time_scale     multiplies every GEMM and elementwise kernel time
  comm_time_scale        multiplies every collective and transfer time
  op_overhead_s          seconds every launched op pays (eager dispatch, allocation)
  collective_overhead_s  seconds every collective call pays (gloo's per-call cost on a busy host)
  step_overhead_s        seconds per optimizer step outside any op
  comm_overlap_efficiency  fraction of the DP/ZeRO communication the separate stream hides (1 on GPUs)
  recompute_overhead_s   seconds per checkpointed layer and micro-batch (torch.utils.checkpoint's own cost)
  sync_wait_scale        multiplies the sync-wait probe's waits at blocking collectives (cost_models/comm.py)
  (selective_recompute_overhead_s, the same per checkpointed attention core, comes from the profile's layer
  probe and is not refitted here: the spread's plans rarely hold a selective one)
  framework_reserve_bytes  memory no tensor accounts for (the runtime's anonymous memory on CPU)

The step-time parameters minimise the sum of squared relative errors (predicted - measured) / measured
over the fitted plans (relative, so a 30 ms plan counts as much as a 300 ms one: what MAPE measures).
The model is not linear in them (overlaps and pipeline bubbles are maxima), so the fit is
Levenberg-Marquardt (Marquardt 1963) on the real cost model with central-difference Jacobians, over the
logarithms of the parameters (keeping them positive), from the best of a few starting points.
`planner tune` fits with priors: the probe's measured compute scale, per-op cost and waits (PRIOR_PARAMETERS,
Hardware.probe_calibration) add their log deviations, weighted, to the residuals, so that what its few
timed plans leave open stays where the probe measured it (fit_parameters).
The memory reserve is additive, so its least-absolute-deviation fit is closed form: the median of
measured - predicted added to the reserve the prediction used.

The plans are split into a fitted half and a held-out half by measured step time (alternate plans in
sorted order, so both halves span the range); the report gives the agreement (planner/validate.py's
MAPE, max error, Kendall tau, regret) on the held-out plans before and after, which is the honest number.
"""

from __future__ import annotations

import dataclasses
import math
import statistics


import numpy as np

from specs.errors import PlannerError
from specs.problem import Problem
from specs.plan import Plan
from planner.reports import Agreement, CalibrationResult, ValidationReport, ValidationRow
from planner.validate import repredict
from specs.hardware import Hardware, with_calibration

# Parameter -> (unit the logarithm is taken against, default when the hardware has none).
TIME_PARAMETERS: dict[str, tuple[float, float]] = {
    "compute_time_scale": (1.0, 1.0),
    "comm_time_scale": (1.0, 1.0),
    "op_overhead_s": (1e-5, 1e-5),
    "collective_overhead_s": (1e-4, 1e-4),
    "step_overhead_s": (1e-3, 1e-3),
    "comm_overlap_efficiency": (1.0, 1.0),
    "recompute_overhead_s": (1e-4, 1e-4),
    "sync_wait_scale": (1.0, 1.0),
}
# Parameters with a natural ceiling (the cost model clamps them there too).
UPPER_BOUNDS = {"comm_overlap_efficiency": 1.0}
# Parameters a probe measures (planner/profiling.py: the layer probe's compute scale and per-op cost), which
# a fit given the probe's values (`priors`) keeps near them unless the timed plans say otherwise.
PRIOR_PARAMETERS = ("compute_time_scale", "op_overhead_s", "sync_wait_scale")
# The weight of a prior's log deviation against a plan's relative error: a plan's step time is known to
# about 10% between interleaved rounds on a busy host and a probe's value to about a factor of 2 (the probe
# times one layer; a step adds its communication threads), so 0.1 / ln 2.
PRIOR_WEIGHT = 0.1 / math.log(2)
# A parameter below unit x exp(LOG_FLOOR) is zero for every purpose; the floor keeps the fit finite.
LOG_FLOOR = -12.0
# And above unit x exp(LOG_CEILING) no parameter is physical (a 1e5x slowdown); it bounds a runaway step.
LOG_CEILING = 12.0


def parameters_at_bounds(calibration: dict[str, float]) -> tuple[str, ...]:
    """The fitted parameters that ended at a bound (zero for every purpose, the runaway ceiling, or a
    natural ceiling): the data did not pin them down, and the fit trades them against the others."""
    out = []
    for name, value in calibration.items():
        unit = TIME_PARAMETERS[name][0] if name in TIME_PARAMETERS else None
        if unit is None:
            continue
        if value <= unit * math.exp(LOG_FLOOR) * 1.01 or value >= unit * math.exp(LOG_CEILING) * 0.99 \
                or (name in UPPER_BOUNDS and value >= UPPER_BOUNDS[name] * 0.999):
            out.append(name)
    return tuple(out)


def ok_rows(rows: list[ValidationRow]) -> list[ValidationRow]:
    return [r for r in rows if r.ok]


def split_held_out(rows: list[ValidationRow], *, held_out_every: int = 2) -> tuple[list[ValidationRow], list[ValidationRow]]:
    """(fit, held out): the plans that ran, sorted by measured step time, every `held_out_every`-th
    (starting with the second) held out, so both halves cover the fast and the slow plans."""
    if held_out_every < 2:
        raise PlannerError(f"--held-out-every must be at least 2, got {held_out_every}")
    ranked = sorted(ok_rows(rows), key=lambda r: r.measured_step_time_s)
    held = [r for i, r in enumerate(ranked) if i % held_out_every == 1]
    fit = [r for i, r in enumerate(ranked) if i % held_out_every != 1]
    return fit, held


def _problem_with(problem: Problem, hardware: Hardware) -> Problem:
    return dataclasses.replace(problem, cluster=dataclasses.replace(problem.cluster, hardware=hardware))


def _predict_step_times(plans: list[Plan], problem: Problem, hardware: Hardware) -> np.ndarray:
    from cost_models.estimate import estimate

    cluster = dataclasses.replace(problem.cluster, hardware=hardware)
    return np.array([estimate(p, model=problem.model, cluster=cluster, job=problem.job).step_time_s for p in plans])


def fit_time_parameters(rows: list[ValidationRow], problem: Problem, *, parameters: tuple[str, ...] = tuple(TIME_PARAMETERS),
                        max_iterations: int = 60) -> tuple[dict[str, float], float]:
    """(calibration, rms relative error) of the step-time parameters fitted to `rows` (module docstring)."""
    return fit_time_parameters_over([(rows, problem)], parameters=parameters, max_iterations=max_iterations)


def fit_time_parameters_over(groups: list[tuple[list[ValidationRow], Problem]], *,
                             parameters: tuple[str, ...] = tuple(TIME_PARAMETERS),
                             max_iterations: int = 60,
                             priors: dict[str, float] | None = None) -> tuple[dict[str, float], float]:
    """fit_time_parameters over rows measured on several problems (the same model and hardware, other
    jobs: a global batch and twice it separate a step's fixed cost from its per-sequence cost, which
    plans of one batch cannot, since every data-parallel plan of it computes the same tokens); `priors`
    as fit_parameters."""
    groups = [(ok_rows(rows), problem) for rows, problem in groups]
    groups = [(rows, problem) for rows, problem in groups if rows]
    if not groups:
        raise PlannerError("no measured plans to fit")

    def predict(hw) -> np.ndarray:
        return np.concatenate([_predict_step_times([r.plan for r in rows], problem, hw) for rows, problem in groups])

    measured = np.array([r.measured_step_time_s for rows, _ in groups for r in rows])
    return fit_parameters(predict, measured, groups[0][1].cluster.hardware, parameters=parameters,
                          max_iterations=max_iterations, priors=priors)


def fit_parameters(predict, measured: np.ndarray, base: Hardware, *, parameters: tuple[str, ...],
                   max_iterations: int = 60, priors: dict[str, float] | None = None) -> tuple[dict[str, float], float]:
    """(calibration, rms relative error of the plans): the `parameters` that make predict(hardware) closest
    to `measured` in squared relative error, starting from `base`'s values (module docstring). `priors`
    (a parameter's measured value, for those of PRIOR_PARAMETERS fitted) add PRIOR_WEIGHT x (log fitted -
    log measured) to the residuals: a maximum a posteriori fit, which keeps what the plans do not pin
    down at what the probe measured. Without it the 13 plans of a tune on a 2-core host left
    compute_time_scale at 0.06 in one run and 1.27 in another (the probe: 0.50), trading it against the
    per-op and per-collective costs."""
    unknown = [p for p in parameters if p not in TIME_PARAMETERS]
    if unknown:
        raise PlannerError(f"unknown calibration parameter {unknown[0]!r}; choose from {', '.join(TIME_PARAMETERS)}")
    if len(measured) < len(parameters):
        raise PlannerError(f"fitting {len(parameters)} parameters needs at least as many measured plans, got {len(measured)}")
    units = np.array([TIME_PARAMETERS[p][0] for p in parameters])

    def calibration_of(u: np.ndarray) -> dict[str, float]:
        values = {p: float(unit * math.exp(max(x, LOG_FLOOR))) for p, unit, x in zip(parameters, units, u)}
        return {p: min(v, UPPER_BOUNDS.get(p, v)) for p, v in values.items()}

    anchored = [(j, math.log(priors[p] / unit)) for j, (p, unit) in enumerate(zip(parameters, units))
                if priors and p in PRIOR_PARAMETERS and priors.get(p, 0) > 0]

    def residuals(u: np.ndarray) -> np.ndarray:
        r = (predict(with_calibration(base, calibration_of(u))) - measured) / measured
        return np.concatenate([r, [PRIOR_WEIGHT * (u[j] - x) for j, x in anchored]]) if anchored else r

    best_u, best_r = None, None

    def fit_from(u0: np.ndarray) -> None:
        nonlocal best_u, best_r
        u, r = _levenberg_marquardt(residuals, u0, max_iterations=max_iterations)
        if best_r is None or float(r @ r) < float(best_r @ best_r):
            best_u, best_r = u, r

    for u0 in _starting_points(base, parameters, units):
        fit_from(u0)
    restart = _overlap_from_the_middle(best_u, parameters, units, calibration_of(best_u))
    if restart is not None:
        fit_from(restart)
    assert best_u is not None and best_r is not None
    plans_r = best_r[:len(measured)]
    return calibration_of(best_u), float(np.sqrt(np.mean(plans_r**2)))


def _starting_points(base: Hardware, parameters: tuple[str, ...], units: np.ndarray) -> list[np.ndarray]:
    """The hardware's current values (or the defaults), and the same with the overheads 10x larger and
    smaller: the overheads and the scales trade off, and LM only finds the nearest minimum."""
    # A share that hides (the overlap probe may read <= 0 on a host with fewer cores than ranks) starts
    # from 5% at least: from the log floor its gradient is nil and the fit could never raise it.
    floors = {"comm_overlap_efficiency": 0.05}
    current = np.array([math.log(max(base.calibration.get(p, _default(base, p)), floors.get(p, 1e-30)) / unit)
                        for p, unit in zip(parameters, units)])
    current = np.maximum(current, LOG_FLOOR)
    overhead = np.array([p.endswith("_overhead_s") for p in parameters])
    return [current, current + math.log(10) * overhead, current - math.log(10) * overhead]


def _overlap_from_the_middle(u: np.ndarray, parameters: tuple[str, ...], units: np.ndarray,
                             calibration: dict[str, float]) -> np.ndarray | None:
    """`u` with the overlap share restarted at the middle of its range when the fit left it at either end,
    else None: from a start near 0, LM can climb to the clamp at 1 and stay there (seen on synthetic ZeRO-3
    twins once gloo's rounds set the collective overheads). Tried only then: every start costs a fit."""
    share = calibration.get("comm_overlap_efficiency")
    if share is None or 0.01 < share < 0.99:
        return None
    j = parameters.index("comm_overlap_efficiency")
    restart = u.copy()
    restart[j] = math.log(0.5 / units[j])
    return restart


def _levenberg_marquardt(residuals, u0: np.ndarray, *, max_iterations: int) -> tuple[np.ndarray, np.ndarray]:
    """Minimise ||residuals(u)||^2 from u0; central-difference Jacobian (a one-sided difference reads
    zero at a clamp such as comm_overlap_efficiency = 1), multiplicative damping."""
    u, r = u0.astype(float), residuals(u0)
    damping, step = 1e-2, 1e-3
    for _ in range(max_iterations):
        jac = np.empty((r.size, u.size))
        for j in range(u.size):
            du = np.zeros_like(u)
            du[j] = step
            jac[:, j] = (residuals(u + du) - residuals(u - du)) / (2 * step)
        gradient, normal = jac.T @ r, jac.T @ jac
        improved = False
        while damping < 1e8:
            delta = np.linalg.solve(normal + damping * np.diag(np.diag(normal) + 1e-12), -gradient)
            candidate = np.clip(u + delta, LOG_FLOOR, LOG_CEILING)
            r_new = residuals(candidate)
            if np.all(np.isfinite(r_new)) and float(r_new @ r_new) < float(r @ r):
                gain = float(r @ r) - float(r_new @ r_new)
                u, r, damping, improved = candidate, r_new, max(damping / 3, 1e-9), True
                break
            damping *= 4
        # Converged: the last step bought less than 1e-4 of the squared error (or 1e-10 absolute). Against
        # 1e-6 on tune's 13 timed plans: the same rms error (0.03302) and parameters within 0.1%, with
        # 10,478 estimates instead of 22,022 (16.5 s instead of 36.2 s on a 2-core host).
        if not improved or gain < 1e-10 + 1e-4 * float(r @ r):
            break
    return u, r


def _default(hw: Hardware, parameter: str) -> float:
    """A parameter's value where the hardware's calibration has none: what the cost model then uses."""
    if parameter == "comm_overlap_efficiency" and hw.device_type == "cuda" and hw.num_sms > 0:
        return 1.0 - hw.nccl_ctas / hw.num_sms  # a start near the contention the GPUs' SMs imply
    return TIME_PARAMETERS[parameter][1]


def fit_memory_reserve(rows: list[ValidationRow], problem: Problem) -> float:
    """framework_reserve_bytes that makes the median memory error of `rows` zero (module docstring)."""
    from cost_models.estimate import estimate

    rows = ok_rows(rows)
    if not rows:
        raise PlannerError("no measured plan to fit the memory reserve to")
    gaps, reserves = [], []
    for r in rows:
        est = estimate(r.plan, model=problem.model, cluster=problem.cluster, job=problem.job)
        gaps.append(r.measured_peak_memory_bytes - est.peak_memory_bytes)
        reserves.append(est.breakdown["framework_reserve_bytes"])
    return float(max(0.0, statistics.median(reserves) + statistics.median(gaps)))


def calibrate(rows: list[ValidationRow], problem: Problem, *, parameters: tuple[str, ...] = tuple(TIME_PARAMETERS),
              held_out_every: int = 2, fit_memory: bool = True) -> CalibrationResult:
    """Fit on part of the measured plans and score on the rest (module docstring). `problem` carries the
    hardware the fit starts from; the result's calibration is what to merge into it."""
    fit, held = split_held_out(rows, held_out_every=held_out_every)
    if not fit:
        raise PlannerError("no plan ran successfully in the measurements; nothing to calibrate against")
    calibration, rms = fit_time_parameters(fit, problem, parameters=parameters)
    if fit_memory:
        calibration["framework_reserve_bytes"] = fit_memory_reserve(fit, problem)
    calibrated = _problem_with(problem, with_calibration(problem.cluster.hardware, calibration))
    return CalibrationResult(
        calibration=calibration, fit_labels=tuple(r.label for r in fit), held_out_labels=tuple(r.label for r in held),
        fit_before=Agreement.of(repredict(fit, problem)), fit_after=Agreement.of(repredict(fit, calibrated)),
        held_out_before=Agreement.of(repredict(held, problem)), held_out_after=Agreement.of(repredict(held, calibrated)),
        rms_relative_error=rms)


def problem_from_report(report: ValidationReport, *, hardware: str | None = None) -> Problem:
    """The problem a validate report was measured on, priced on `hardware` (default: the report's)."""
    from specs.problem import make_problem

    return make_problem(model=report.model, hardware=hardware or report.hardware, gpus=report.nproc,
                        gpus_per_node=report.nproc, global_batch=report.global_batch, seq_len=report.seq_len,
                        precision=report.precision)


def calibration_runs(rows, *, model: str, global_batch: int, seq_len: int, precision: str, processes: int) -> tuple:
    """The rows that ran, as the profile's record of what its calibration timed (Hardware.calibration_runs,
    the reference planner/validate.host_speed_ratios compares later runs with)."""
    from specs.hardware import CalibrationRun

    return tuple(CalibrationRun(model=model, plan=r.plan.to_dict(), global_batch=global_batch, seq_len=seq_len,
                                precision=precision, processes=processes, step_time_s=r.measured_step_time_s)
                 for r in rows if r.ok)


def default_parameters(hardware: Hardware) -> tuple[str, ...]:
    """Every step-time parameter, less sync_wait_scale where the profile has no sync-wait probe keys (it would
    scale nothing there, and the fit cannot place it)."""
    from cost_models.comm import has_sync_waits

    waits = has_sync_waits(hardware.calibration)
    return tuple(p for p in TIME_PARAMETERS if waits or p != "sync_wait_scale")


def calibrate_measurements(path: str, *, hardware: str | None, out: str | None, held_out_every: int = 2,
                           fit_memory: bool = True, parameters: tuple[str, ...] | None = None) -> tuple[str, CalibrationResult]:
    """`planner calibrate`: fit to a `planner validate --out` report and write the calibrated profile to
    `out`, or over the profile file the fit started from (never over a preset). Returns (where it was
    written, the result)."""
    from specs.hardware import PRESETS
    from specs.jsonio import read_json_file

    report = ValidationReport.from_dict(read_json_file(path, what="measurements"), what=f"measurements file {path}")
    problem = problem_from_report(report, hardware=hardware)
    source = hardware or report.hardware
    target = out or (None if source in PRESETS else source)
    if target is None:
        raise PlannerError(f"--hardware {source} is a preset; give --out for the calibrated profile")
    parameters = parameters or default_parameters(problem.cluster.hardware)
    result = calibrate(list(report.plans), problem, parameters=parameters,
                       held_out_every=held_out_every, fit_memory=fit_memory)
    calibrated = with_calibration(problem.cluster.hardware, result.calibration)
    runs = calibration_runs(report.plans, model=report.model, global_batch=report.global_batch, seq_len=report.seq_len,
                            precision=report.precision, processes=report.nproc)
    dataclasses.replace(calibrated, calibrated_from_runs=len(result.fit_labels), calibration_runs=runs).save(target)
    return target, result


# What a GPU user's own runs (`planner calibrate --from-runs`) pin down: the GPUs' sustained compute rate,
# their links, and how much of the communication their engine overlaps really hides.
RUNS_PARAMETERS = ("compute_time_scale", "comm_time_scale", "comm_overlap_efficiency")


def _runs_rows(runs, hardware: Hardware) -> list[ValidationRow]:
    """The runs as validation rows, priced on `hardware` (each as its engine runs it)."""
    from cost_models.estimate import estimate

    rows = []
    for run in runs:
        hw = dataclasses.replace(hardware, inter_node=run.cluster.hardware.inter_node)
        est = estimate(run.plan, model=run.model, cluster=dataclasses.replace(run.cluster, hardware=hw),
                       job=run.job, engine=run.priced_engine)
        peak = run.measured_peak_memory_bytes
        rows.append(ValidationRow(
            label=run.label, source=run.engine, plan=run.plan, status="ok", error=None,
            predicted_step_time_s=est.step_time_s, predicted_peak_memory_bytes=est.peak_memory_bytes,
            measured_step_time_s=run.measured_step_time_s, measured_peak_memory_bytes=None if peak is None else int(peak)))
    return rows


def _fit_runs_reserve(runs, hardware: Hardware) -> float | None:
    """framework_reserve_bytes making the median memory error of the runs with a measured peak zero."""
    from cost_models.estimate import estimate

    gaps, reserves = [], []
    for run in runs:
        if run.measured_peak_memory_bytes is None:
            continue
        hw = dataclasses.replace(hardware, inter_node=run.cluster.hardware.inter_node)
        est = estimate(run.plan, model=run.model, cluster=dataclasses.replace(run.cluster, hardware=hw),
                       job=run.job, engine=run.priced_engine)
        gaps.append(run.measured_peak_memory_bytes - est.peak_memory_bytes)
        reserves.append(est.breakdown["framework_reserve_bytes"])
    if not gaps:
        return None
    return float(max(0.0, statistics.median(reserves) + statistics.median(gaps)))


def calibrate_from_runs(path: str, *, hardware: str, out: str | None, held_out_every: int = 2,
                        parameters: tuple[str, ...] | None = None, fit_memory: bool = True) -> tuple[str, CalibrationResult]:
    """`planner calibrate --from-runs`: fit the profile's free parameters to a cluster's past training runs
    (any engine: Megatron-LM, torchtitan, DeepSpeed, FSDP, this one; columns in planner/published.py) and
    write the calibrated profile to `out` (or over the --hardware profile file; never over a preset).

    The runs sorted by measured step time, every `held_out_every`-th is held out of the fit (with fewer
    than four runs all are fitted and nothing is held out); the result reports both sets before and after."""
    from planner.published import load_published, price
    from specs.hardware import PRESETS, resolve_hardware

    base = resolve_hardware(hardware)
    target = out or (None if hardware in PRESETS else hardware)
    if target is None:
        raise PlannerError(f"--hardware {hardware} is a preset; give --out for the calibrated profile")
    if base.device_type != "cuda":
        raise PlannerError("--from-runs calibrates a GPU profile from GPU runs; for this host's own runs use "
                           "planner validate and planner calibrate --measurements")
    runs, _ = load_published(path, hardware=base, strict=True)
    parameters = parameters or RUNS_PARAMETERS
    if held_out_every < 2:
        raise PlannerError(f"--held-out-every must be at least 2, got {held_out_every}")
    ranked = sorted(runs, key=lambda r: r.measured_step_time_s)
    held = [r for i, r in enumerate(ranked) if i % held_out_every == 1] if len(ranked) >= 4 else []
    fit = [r for r in ranked if r not in held]
    calibration, rms = fit_parameters(lambda hw: np.array([price(r, hardware=hw) for r in fit]),
                                      np.array([r.measured_step_time_s for r in fit]), base, parameters=parameters)
    calibrated = with_calibration(base, calibration)
    if fit_memory:
        reserve = _fit_runs_reserve(fit, calibrated)
        if reserve is not None:
            calibration["framework_reserve_bytes"] = reserve
            calibrated = with_calibration(base, calibration)
    result = CalibrationResult(
        calibration=calibration, fit_labels=tuple(r.label for r in fit), held_out_labels=tuple(r.label for r in held),
        fit_before=Agreement.of(_runs_rows(fit, base)), fit_after=Agreement.of(_runs_rows(fit, calibrated)),
        held_out_before=Agreement.of(_runs_rows(held, base)), held_out_after=Agreement.of(_runs_rows(held, calibrated)),
        rms_relative_error=rms)
    dataclasses.replace(calibrated, calibrated_from_runs=len(fit)).save(target)
    return target, result
