"""`planner tune`: the main job in one command: profile this node (or reuse its cached profile), search
with that profile as the hardware, train the winner on our engine for a few steps, and report measured
against predicted.

    planner tune                                   # tiny model on 2 local CPU processes
    planner tune --nproc 4 --global-batch 16 --steps 10 --format json
    planner tune --refresh-profile                 # measure again instead of reusing the cache

The profile is this machine's (planner/machine.py): cached in ~/.cache/planner/ (or $PLANNER_CACHE_DIR)
under the host name and process count, since both change what one process can do, and shared with run,
validate, estimate and search; `planner calibrate` results written into that file are used by all of them.

Closing the loop: the profile's probes fit the CPU's per-op cost, compute slowdown and overlap from one
layer (runners/probe.py), but not what a whole engine step adds (hooks, the optimizer step,
collectives under load). So when the profile has never been fitted to training runs, tune times a
handful of real plans first (the search's top 3 and the validation spread, CALIBRATION_PLANS in all, and
CALIBRATION_PLANS_2X more at twice the global batch, and the no-prefetch twin of a ZeRO-3 plan among
them) in batched, interleaved torchrun launches (planner/validate.py), fits CALIBRATION_PARAMETERS (and,
with the twin, OVERLAP_PARAMETER) to them by
least squares (planner/calibrate.py), writes the result into the profile, and searches on the
calibrated profile. The next tune reuses it (`--no-calibrate` skips the step; `--recalibrate` redoes it).

The host check: a shared host's speed drifts. On the 2-core development VM the same plan's median step
(dp4, 4 processes, 10 steps a run) read 127-158 ms over five runs in four minutes, and tune's calibration
(two interleaved rounds over ~70 s) once timed its later winner at 163-166 ms against 132 ms in the run a
minute after: measured / predicted 0.78 with the prediction fitted to the slower window. So after the run,
tune times the winner again in one batched, interleaved run (runners/timing.py) beside HOST_CHECK_PLANS of
the plans the calibration timed at these settings (the closest in step time), whose measured now / measured
then is the host's speed against the calibration's (as in planner/validate.host_speed_ratios, here from plans
other than the winner, so it does not take the winner's own error out). The report's measured / predicted is
the winner's step in that window over its prediction at that speed, with the run's own step over the
prediction at the profile's speed beside it (`--no-host-check` skips the check and leaves only the latter).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from planner.reports import HostCheck, TuneCalibration, TuneReport, ValidationRow
from specs.errors import PlannerError

Progress = Callable[[str, int, "int | None", str], None]

# Plans timed to calibrate, and the parameters fitted to them: few enough for ~8 plans to pin down, and
# the ones the probes leave out (a step's fixed cost, collectives under load) or may misjudge.
CALIBRATION_PLANS = 8
# And at twice the batch (calibrate_profile says why): the search's pick and the spread's first plans.
CALIBRATION_PLANS_2X = 4
CALIBRATION_PARAMETERS = ("compute_time_scale", "op_overhead_s", "collective_overhead_s", "step_overhead_s")
# Fitted too when the timed plans hold a ZeRO-3 plan that prefetches and its twin that does not
# (`with_prefetch_twin`): the pair differs only in the gathers hidden behind compute, so it pins the share
# that hides (the profile's overlap probe is the starting value). Without the twin this parameter trades
# off against compute_time_scale and step_overhead_s: fitted alone from 12 plans in a fresh clone it ran
# to its bounds (efficiency 1, compute scale 3.14, step overhead 0).
OVERLAP_PARAMETER = "comm_overlap_efficiency"
# Fitted too where the profile's sync-wait probe measured waits (cost_models/comm.sync_wait_s, CPU): the factor
# on them, held by a prior at the probe's 1 (planner/calibrate.PRIOR_PARAMETERS). The probe times synthetic
# segments, where a step's meetings may wait less: in a 4-process fresh clone the unscaled waits took the time
# of tune's TP plans from collective_overhead_s (fitted to 0) and from the compute scale, which then priced the
# data-parallel plans of `planner validate` 18-25% fast (MAPE 12.3%); fitted, the factor came out 0.57 there
# (MAPE 11.6%), 0.96 at 2 processes.
SYNC_WAIT_PARAMETER = "sync_wait_scale"
# Below this share of the layer probe's compute_time_scale the fit has priced the timed plans' kernels at
# almost nothing and put their time into per-op and per-step costs: it fits plans of the timed shapes, but
# a larger model or sequence, whose kernels do cost time, is predicted too fast. Seen in a fresh-clone
# 4-process tune: 0.0002 against the probe's 2.2 (the tiny model's 96-wide kernels are dispatch-bound).
DEGENERATE_COMPUTE_SHARE = 0.1
# The host check (module docstring): calibration plans re-timed beside the winner, and the interleaved rounds.
HOST_CHECK_PLANS = 3
HOST_CHECK_ROUNDS = 4
HOST_CHECK_STEPS = 2


def _no_progress(stage: str, done: int, total: int | None, label: str) -> None:
    pass


@dataclass(frozen=True)
class TuneSettings:
    model: str = "tiny"
    nproc: int | None = None  # None: planner.machine.default_nproc()
    global_batch: int = 8
    seq_len: int = 64
    precision: str | None = None
    steps: int = 8
    profile: str | None = None  # a profile JSON to use as is; None: the cache (measured when missing)
    refresh_profile: bool = False
    cache_dir: str | None = None
    seed: int = 0
    timeout_s: float = 300.0
    calibrate: bool = True  # fit the profile to timed runs when it never was
    recalibrate: bool = False  # fit it again even if it was
    host_check: bool = True  # time the winner again beside calibration plans (module docstring)

    def __post_init__(self) -> None:
        from planner.machine import default_nproc

        object.__setattr__(self, "nproc", default_nproc() if self.nproc is None else self.nproc)
        if self.nproc < 2:
            raise PlannerError(f"--nproc must be at least 2 (the profile measures collectives), got {self.nproc}")
        if self.steps < 2:
            raise PlannerError(f"--steps must be at least 2 (the first step is a warm-up), got {self.steps}")
        if self.profile is not None and self.refresh_profile:
            raise PlannerError("give either --profile or --refresh-profile, not both")


def cached_profile_path(settings: TuneSettings) -> Path:
    """The cache entry for this host and process count (planner/machine.py)."""
    from planner.machine import cached_profile_path as path_for

    return path_for(settings.nproc, directory=settings.cache_dir)


def ensure_profile(settings: TuneSettings, *, progress: Progress = _no_progress) -> tuple[str, bool]:
    """(profile path, whether it was reused): the given one, or this host's for the process count, measured
    when none usable is cached (planner.machine.local_profile)."""
    from planner.machine import local_profile
    from specs.hardware import resolve_hardware

    if settings.profile is not None:
        resolve_hardware(settings.profile)  # refuse a bad file before anything runs
        return settings.profile, True
    return local_profile(settings.nproc, model=settings.model, refresh=settings.refresh_profile,
                         directory=settings.cache_dir, progress=progress)


def calibrate_profile(profile: str, settings: TuneSettings, *, progress: Progress = _no_progress) -> TuneCalibration:
    """Time CALIBRATION_PLANS plans at the run's global batch and CALIBRATION_PLANS_2X at twice it (each
    batch one batched interleaved run), fit CALIBRATION_PARAMETERS to all of them, and write the
    calibrated profile back to `profile`; returns what was fitted and how well.

    Why two batches: at one global batch every data-parallel plan computes the same tokens per rank, so
    a step's fixed cost (step_overhead_s) and its per-sequence cost (compute_time_scale) trade off and the
    fit may split them wrongly; it then holds at that batch and not at another. Measured in a fresh clone:
    fitted at batch 8 alone, step_overhead_s came out 11.7 ms, and `planner validate` at its batch of 16
    found every plan 10-37% slower than predicted (the winner's shape 31.2 ms at 8 sequences, 55.1 ms at 16:
    7 ms fixed, 24 ms per 8 sequences, where the fit had 11.7 and 18)."""
    from planner.calibrate import _predict_step_times, calibration_runs, fit_time_parameters_over, parameters_at_bounds
    from planner.validate import ValidateSettings, candidate_plans, measure_step_times_batched
    from specs.hardware import resolve_hardware, with_calibration

    groups, runs = [], []
    for batch, count, top_k in ((settings.global_batch, CALIBRATION_PLANS, 3),
                                (2 * settings.global_batch, CALIBRATION_PLANS_2X, 1)):
        vs = ValidateSettings(model=settings.model, hardware=profile, nproc=settings.nproc, global_batch=batch,
                              seq_len=settings.seq_len, precision=settings.precision or _default_precision(profile),
                              seed=settings.seed, timeout_s=settings.timeout_s)
        problem = vs.problem()
        entries = candidate_plans(problem, top_k=top_k, max_plans=count)
        if batch == settings.global_batch:
            entries = with_prefetch_twin(entries)
        progress("calibrate", 0, None, f"timing {len(entries)} plans at global batch {batch}")
        times = measure_step_times_batched(entries, vs, rounds=2, steps_per_round=3,
                                           progress=lambda done, total, label: progress("calibrate", done, total, label))
        rows = [ValidationRow(label=e.label, source=e.source, plan=e.plan, status="ok", error=None,
                              predicted_step_time_s=0.0, predicted_peak_memory_bytes=0,
                              measured_step_time_s=statistics.median(t)) for e, t in zip(entries, times) if t]
        groups.append((rows, problem))
        runs += calibration_runs(rows, model=settings.model, global_batch=batch, seq_len=settings.seq_len,
                                 precision=vs.precision, processes=settings.nproc)
    num_rows = sum(len(rows) for rows, _ in groups)
    hardware = resolve_hardware(profile)
    parameters, priors = fitted_parameters([r.plan for rows, _ in groups for r in rows], hardware)
    calibration, _ = fit_time_parameters_over(groups, parameters=parameters, priors=priors)
    calibrated = dataclasses.replace(with_calibration(hardware, calibration), calibrated_from_runs=num_rows,
                                     calibration_runs=tuple(runs))

    def errors(hw) -> list[float]:
        return [predicted / r.measured_step_time_s - 1 for rows, problem in groups
                for r, predicted in zip(rows, _predict_step_times([r.plan for r in rows], problem, hw))]

    before, after = errors(hardware), errors(calibrated)
    calibrated.save(profile)
    probe_scale = hardware.calibration.get("compute_time_scale")
    return TuneCalibration(num_plans=num_rows, parameters=calibration,
                           mape_before=statistics.fmean(map(abs, before)), mape_after=statistics.fmean(map(abs, after)),
                           rms_before=math.sqrt(statistics.fmean(e * e for e in before)),
                           rms_after=math.sqrt(statistics.fmean(e * e for e in after)),
                           at_bounds=parameters_at_bounds(calibration),
                           compute_scale_of_probe=calibration["compute_time_scale"] / probe_scale
                           if probe_scale and "compute_time_scale" in calibration else None)


def fitted_parameters(plans: list, hardware) -> tuple[tuple[str, ...], dict[str, float]]:
    """(parameters, priors) of tune's fit over the timed `plans`: CALIBRATION_PARAMETERS (as many as the plans
    pin down), OVERLAP_PARAMETER where they hold a prefetch pair, SYNC_WAIT_PARAMETER where the profile measured
    sync waits, each while plans remain to spare; priors: the probes' values (the waits' factor: 1)."""
    from cost_models.comm import has_sync_waits

    parameters = CALIBRATION_PARAMETERS[:max(1, min(len(CALIBRATION_PARAMETERS), len(plans) - 1))]
    if _has_prefetch_pair(plans) and len(plans) > len(parameters) + 1:
        parameters += (OVERLAP_PARAMETER,)
    priors = dict(hardware.probe_calibration)
    if has_sync_waits(hardware.calibration) and len(plans) > len(parameters) + 1:
        parameters += (SYNC_WAIT_PARAMETER,)
        priors.setdefault(SYNC_WAIT_PARAMETER, 1.0)
    return parameters, priors


def _prefetch_twin(plan):
    """The same plan without parameter prefetch, for a plan that gathers sharded parameters ahead; else None."""
    return plan.replace(prefetch_depth=0) if plan.param_shard > 1 and plan.prefetch_depth > 0 else None


def with_prefetch_twin(entries: list) -> list:
    """`entries` and, after them, the no-prefetch twin of the first ZeRO-3 plan that prefetches (none if
    there is no such plan or its twin is already timed)."""
    from planner.validate import PlanEntry

    plans = {e.plan for e in entries}
    for e in entries:
        twin = _prefetch_twin(e.plan)
        if twin is not None:
            return entries if twin in plans else [*entries, PlanEntry(f"{e.label} no prefetch", e.source, twin)]
    return entries


def _has_prefetch_pair(plans: list) -> bool:
    timed = set(plans)
    return any(_prefetch_twin(p) in timed for p in plans)


def _default_precision(profile: str) -> str:
    from specs.hardware import resolve_hardware

    return "fp32" if resolve_hardware(profile).device_type == "cpu" else "bf16"


def tune(settings: TuneSettings = TuneSettings(), *, progress: Progress = _no_progress,
         on_step: Callable[[dict], None] | None = None) -> TuneReport:
    """Profile, search, run the winner, and return the report (see `report_lines`)."""
    from specs.problem import make_problem
    from planner.search import SearchOptions, search
    from runners.config import RunConfig
    from runners.launch import RunFailed, Where, launch

    from specs.hardware import resolve_hardware

    start = time.perf_counter()
    profile, reused = ensure_profile(settings, progress=progress)
    profiled = time.perf_counter()
    calibration = None
    if settings.recalibrate or (settings.calibrate and resolve_hardware(profile).calibrated_from_runs == 0):
        calibration = calibrate_profile(profile, settings, progress=progress)
    calibrated_at = time.perf_counter()
    progress("search", 0, None, "searching")
    problem = make_problem(model=settings.model, hardware=profile, gpus=settings.nproc, gpus_per_node=settings.nproc,
                           global_batch=settings.global_batch, seq_len=settings.seq_len, precision=settings.precision)
    result = search(problem, options=SearchOptions(top_k=3))
    winner = result.winner
    searched = time.perf_counter()
    progress("train", 0, settings.steps, winner.plan.describe())
    cfg = RunConfig(plan=winner.plan, model=problem.model, job=problem.job, steps=settings.steps, seed=settings.seed,
                    ranks_per_node=settings.nproc, timeout_s=settings.timeout_s, predicted=winner.estimate.to_dict())
    metrics = launch(cfg, where=Where(nproc=settings.nproc), on_step=on_step)
    if metrics is None:
        raise PlannerError("the run wrote no metrics")
    trained = time.perf_counter()
    checked, check_error = None, None
    if settings.host_check:
        # The run is done and its report is what the user came for: a host check that fails (a reference
        # plan's rank dies, the host runs out of memory) is reported beside it, never in its place.
        try:
            checked = host_check(winner.plan, winner.estimate.step_time_s, profile, settings, progress=progress)
        except (RunFailed, PlannerError) as exc:
            check_error = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    done = time.perf_counter()
    return TuneReport(
        profile=profile, profile_reused=reused, calibrated_from_runs=problem.cluster.hardware.calibrated_from_runs,
        calibration=calibration, plan=winner.plan, runner_up=tuple(c.plan.describe() for c in result.candidates[1:3]),
        predicted=winner.estimate.to_dict(), measured=metrics.summary, losses=tuple(metrics.losses),
        step_times_s=tuple(s.step_time_s for s in metrics.steps[1:]), host_check=checked,
        host_check_error=check_error,
        times_s={"profile": profiled - start, "calibrate": calibrated_at - profiled, "search": searched - calibrated_at,
                 "run": trained - searched, "host_check": done - trained, "total": done - start})


def host_check(winner, predicted: float, profile: str, settings: TuneSettings, *,
               progress: Progress = _no_progress) -> HostCheck | None:
    """Time `winner` interleaved with up to HOST_CHECK_PLANS other plans the profile's calibration timed at
    these settings (those closest to the winner's `predicted` step time, seconds), and return the host's speed
    against the calibration's (module docstring); None where the calibration timed no other plan here."""
    import json

    from planner.validate import (PlanEntry, ValidateSettings, calibration_step_times, measure_step_times_batched,
                                  plan_key)
    from specs.hardware import resolve_hardware
    from specs.plan import Plan

    precision = settings.precision or _default_precision(profile)
    then = calibration_step_times(resolve_hardware(profile), model=settings.model, global_batch=settings.global_batch,
                                  seq_len=settings.seq_len, precision=precision, processes=settings.nproc)
    then.pop(plan_key(winner.to_dict()), None)
    if not then:
        return None
    vs = ValidateSettings(model=settings.model, hardware=profile, nproc=settings.nproc,
                          global_batch=settings.global_batch, seq_len=settings.seq_len, precision=precision,
                          seed=settings.seed, timeout_s=settings.timeout_s)
    chosen = sorted(then, key=lambda k: abs(math.log(then[k] / predicted)))[:HOST_CHECK_PLANS]
    references = [Plan.from_dict(json.loads(k)) for k in chosen]
    entries = [PlanEntry("winner", "search", winner)] + [
        PlanEntry(f"reference {i + 1}", "calibration", plan) for i, plan in enumerate(references)]
    progress("host check", 0, None, f"timing the winner beside {len(references)} calibration plan(s)")
    times = measure_step_times_batched(entries, vs, rounds=HOST_CHECK_ROUNDS, steps_per_round=HOST_CHECK_STEPS,
                                       progress=lambda done, total, label: progress("host check", done, total, label))
    ratios = tuple(statistics.median(t) / then[k] for k, t in zip(chosen, times[1:]))
    return HostCheck(factor=statistics.median(ratios), winner_step_time_s=statistics.median(times[0]),
                     references=tuple(p.describe() for p in references), reference_ratios=ratios)


def host_lines(report: TuneReport) -> list[str]:
    """The step-time lines: at the host's speed now (the host check) and as the run measured it against the
    profile's speed."""
    check, p, m = report.host_check, report.predicted, report.measured
    spread = report.step_time_ratio_quartiles
    own = (f"its own run measured {m.median_step_time_s * 1e3:.1f} ms against {p['step_time_s'] * 1e3:.1f} ms "
           f"predicted at the profile's speed (measured / predicted {report.step_time_ratio_at_profile_speed:.2f}"
           + (f", its steps' interquartile range {spread[0]:.2f}-{spread[1]:.2f})" if spread else ")"))
    if report.host_check_error is not None:
        return [f"step time: {own}", f"host check failed (the run above stands; measured / predicted at the "
                                     f"profile's speed only): {report.host_check_error}"]
    if check is None:
        return [f"step time: {own}"]
    at_speed = p["step_time_s"] * check.factor
    return [f"step time: measured {check.winner_step_time_s * 1e3:.1f} ms beside {len(check.references)} calibration "
            f"plan(s) that ran {check.factor:.2f}x their calibration time "
            f"({', '.join(f'{r:.2f}' for r in check.reference_ratios)}), predicted {at_speed * 1e3:.1f} ms at that "
            f"speed (measured / predicted {report.step_time_ratio_at_host_speed:.2f})", f"  {own}"]


def report_lines(report: TuneReport) -> list[str]:
    """The terminal summary of a tune report."""
    p, m, times = report.predicted, report.measured, report.times_s
    fitted = report.calibrated_from_runs
    lines = [
        f"profile: {report.profile} ({'reused' if report.profile_reused else 'measured now'}"
        f"{f', calibrated on {fitted} timed plans' if fitted else ', probes only'}) in {times['profile']:.1f} s",
        f"best plan: {report.plan.describe()} (searched in {times['search']:.1f} s)",
        f"trained {len(report.losses)} steps in {times['run']:.1f} s: loss {report.losses[0]:.4f} -> "
        f"{report.losses[-1]:.4f}",
        *host_lines(report),
        f"peak memory per rank: measured {m.peak_memory_bytes / 2**20:.1f} MiB, predicted "
        f"{p['peak_memory_bytes'] / 2**20:.1f} MiB (measured / predicted {report.memory_ratio:.2f})",
        f"total {times['total']:.1f} s",
    ]
    if report.calibration is not None:
        c = report.calibration
        lines.insert(1, f"calibrated on {c.num_plans} timed plans in {times['calibrate']:.1f} s: "
                        f"their mean |error| {c.mape_before:.0%} -> {c.mape_after:.0%} ("
                        + ", ".join(f"{k} {v:.3g}" for k, v in c.parameters.items()) + ")")
    if report.calibration is not None and report.calibration.at_bounds:
        lines.append(f"warning: the calibration left {', '.join(report.calibration.at_bounds)} at a bound: the timed "
                     f"plans did not pin it down, so the fit may not carry to other plans (`planner tune "
                     f"--recalibrate` on a quieter host, or `planner validate` then `planner calibrate`)")
    share = report.calibration.compute_scale_of_probe if report.calibration is not None else None
    if share is not None and share < DEGENERATE_COMPUTE_SHARE:
        lines.append(f"warning: the calibration priced compute at {share:.2g}x of what the layer probe measured "
                     f"(compute_time_scale {report.calibration.parameters['compute_time_scale']:.3g}): the timed "
                     f"plans' time went into per-op and per-step costs, so this profile will predict a larger "
                     f"model or sequence too fast; calibrate it on runs of that size (`planner validate --model "
                     f"... --hardware {report.profile} --out v.json`, then `planner calibrate`)")
    if not fitted and abs(report.step_time_ratio_at_profile_speed - 1) > 0.2:
        lines.append("the profile was never fitted to training runs; run `planner tune --recalibrate`, or "
                     f"`planner validate --hardware {report.profile} --out v.json` then `planner calibrate`")
    return lines
