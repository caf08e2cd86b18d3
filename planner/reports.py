"""The application's typed results: validation rows and reports, their agreement statistics, the
calibration result and the tune report. Each has a JSON form (`to_dict` / `from_dict`); derived
quantities (errors, ratios) are properties, written into the JSON for readers but never read back.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass, field
from typing import Callable

from runners.config import RunSummary
from specs.errors import PlannerError
from specs.jsonio import dataclass_from_dict
from specs.plan import Plan


# Step-time samples a row needs before its spread (interquartile range) is taken as the noise.
MIN_SAMPLES_FOR_SPREAD = 4
# Reference plans (timed now and in the profile's calibration) a validation needs before it takes its
# predictions at the host's speed now: with two, each reference's own prediction still has the other's.
MIN_HOST_REFERENCES = 2
# A validation report row's prediction at the host's speed now (derived, not read back).
HOST_SPEED_PREDICTION = "predicted_at_host_speed_s"


def _relative_error(predicted: float, measured: float | None) -> float | None:
    return None if measured is None else (predicted - measured) / measured


@dataclass(frozen=True)
class ValidationRow:
    """One plan of a validation: what the cost model predicted and, if it ran, what was measured."""

    label: str
    source: str  # "search" or "spread"
    plan: Plan
    status: str  # "ok" or "failed"
    error: str | None
    predicted_step_time_s: float
    predicted_peak_memory_bytes: int
    measured_step_time_s: float | None = None
    measured_peak_memory_bytes: int | None = None
    rounds_step_time_s: tuple[float, ...] = ()  # per run: its median step
    batched_step_times_s: tuple[float, ...] = ()  # every step of the batched timing run

    DERIVED = ("describe", "step_time_error", "memory_error", "measured_quartiles_s")

    @property
    def ok(self) -> bool:
        return self.status == "ok" and self.measured_step_time_s is not None

    @property
    def describe(self) -> str:
        return self.plan.describe()

    @property
    def step_time_error(self) -> float | None:
        return _relative_error(self.predicted_step_time_s, self.measured_step_time_s)

    @property
    def memory_error(self) -> float | None:
        return _relative_error(self.predicted_peak_memory_bytes, self.measured_peak_memory_bytes)

    @property
    def measured_quartiles_s(self) -> tuple[float, float] | None:
        """The first and third quartiles of the measured step times (the batched run's steps, else the
        runs' medians), or None with fewer than MIN_SAMPLES_FOR_SPREAD of them."""
        samples = self.batched_step_times_s or self.rounds_step_time_s
        if not self.ok or len(samples) < MIN_SAMPLES_FOR_SPREAD:
            return None
        q1, _, q3 = statistics.quantiles(samples, n=4)
        return (q1, q3)

    def separable_from(self, other: "ValidationRow") -> bool:
        """Whether the two measured step times differ beyond the noise: their interquartile ranges do not
        overlap (a row without a spread counts its median as exact)."""
        a = self.measured_quartiles_s or (self.measured_step_time_s,) * 2
        b = other.measured_quartiles_s or (other.measured_step_time_s,) * 2
        return a[1] < b[0] or b[1] < a[0]

    def replace(self, **changes: object) -> "ValidationRow":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out.update(plan=self.plan.to_dict(), rounds_step_time_s=list(self.rounds_step_time_s),
                   batched_step_times_s=list(self.batched_step_times_s))
        out.update({k: getattr(self, k) for k in self.DERIVED})
        return out

    @classmethod
    def from_dict(cls, data: object, *, what: str = "validation row") -> "ValidationRow":
        if isinstance(data, dict):
            data = {k: v for k, v in data.items() if k not in cls.DERIVED}
        return dataclass_from_dict(cls, data, what=what)


def kendall_tau(x: list[float], y: list[float]) -> float | None:
    """Kendall's tau-b of two paired samples (ties in either counted as Knight's correction does);
    None with fewer than two pairs or when one side is constant."""
    n = len(x)
    if n != len(y):
        raise ValueError(f"kendall_tau needs paired samples, got {n} and {len(y)}")
    concordant = discordant = ties_x = ties_y = 0
    for i in range(n):
        for j in range(i + 1, n):
            dx, dy = x[i] - x[j], y[i] - y[j]
            if dx == 0 and dy == 0:
                continue
            if dx == 0:
                ties_x += 1
            elif dy == 0:
                ties_y += 1
            elif (dx > 0) == (dy > 0):
                concordant += 1
            else:
                discordant += 1
    denom = math.sqrt((concordant + discordant + ties_x) * (concordant + discordant + ties_y))
    return (concordant - discordant) / denom if denom > 0 else None


@dataclass(frozen=True)
class Agreement:
    """How well predictions match measurements over the rows that ran (None where there are too few).

    mape: mean |predicted - measured| / measured; max_error: the largest of those; kendall_tau: between
    predicted and measured step times; regret: measured time of the predicted-fastest plan over the best
    measured time, minus 1, counted only when the two are separable (their measured interquartile
    ranges do not overlap; ValidationRow.separable_from), else 0 with `top_pick_within_noise` set, and
    `raw_regret` the ratio as measured; memory_mape / memory_max_error: the same for peak memory."""

    num_ok: int = 0
    mape: float | None = None
    max_error: float | None = None
    kendall_tau: float | None = None
    regret: float | None = None
    top_pick: str | None = None
    best_measured: str | None = None
    memory_mape: float | None = None
    memory_max_error: float | None = None
    raw_regret: float | None = None
    top_pick_within_noise: bool | None = None

    @classmethod
    def of(cls, rows: list[ValidationRow], *, speed: "Callable[[ValidationRow], float] | None" = None) -> "Agreement":
        """`speed(row)` scales each row's prediction for the errors (ValidationReport.host_speed_for); the
        ranking (tau, the top pick, regret) is the cost model's own, which one speed for all does not move."""
        ok = [r for r in rows if r.ok]
        if not ok:
            return cls()
        errors = [abs(r.predicted_step_time_s * (speed(r) if speed else 1.0) / r.measured_step_time_s - 1)
                  for r in ok]
        memory = [abs(r.memory_error) for r in ok if r.memory_error is not None]
        top = min(ok, key=lambda r: r.predicted_step_time_s)
        best = min(ok, key=lambda r: r.measured_step_time_s)
        raw = top.measured_step_time_s / best.measured_step_time_s - 1.0
        within_noise = top is not best and not top.separable_from(best)
        return cls(num_ok=len(ok), mape=statistics.fmean(errors), max_error=max(errors),
                   kendall_tau=kendall_tau([r.predicted_step_time_s for r in ok], [r.measured_step_time_s for r in ok]),
                   regret=0.0 if within_noise else raw, top_pick=top.label,
                   best_measured=best.label, memory_mape=statistics.fmean(memory) if memory else None,
                   memory_max_error=max(memory) if memory else None, raw_regret=raw,
                   top_pick_within_noise=within_noise)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class ValidationReport:
    """`planner validate --out`: what was validated, how, each plan's row and the agreement (whose
    fields the JSON form puts at the top level)."""

    model: str
    hardware: str
    hardware_name: str
    calibration: dict[str, float]
    nproc: int
    cluster: str | None
    global_batch: int
    seq_len: int
    precision: str
    steps: int
    rounds: int
    timing_rounds: int
    plans: tuple[ValidationRow, ...]
    # The host's speed now against when the profile was calibrated (planner/validate.host_speed_ratios):
    # per reference plan, timed now in the same interleaved run as the validated plans and then in the
    # calibration, (label, measured now / measured then); the factor is their median (above 1: slower now).
    host_speed_factor: float | None = None
    host_speed_plans: int = 0
    host_speed_ratios: tuple[tuple[str, float], ...] = ()

    @property
    def at_host_speed(self) -> bool:
        """Whether the predictions are taken at the host's speed now (MIN_HOST_REFERENCES references or more)."""
        return len(self.host_speed_ratios) >= MIN_HOST_REFERENCES

    def host_speed_for(self, row: ValidationRow) -> float:
        """The factor `row`'s prediction is scaled by: the median of the other references' now / then (a
        reference's own time never enters its own prediction); 1 (the profile's speed) with too few."""
        others = [ratio for label, ratio in self.host_speed_ratios if label != row.label]
        return statistics.median(others) if self.at_host_speed and others else 1.0

    @property
    def agreement(self) -> Agreement:
        """At the host's speed now where it was measured (the headline), else at the profile's."""
        return Agreement.of(list(self.plans), speed=self.host_speed_for)

    @property
    def agreement_at_profile_speed(self) -> Agreement:
        """Every prediction as the profile prices it, whatever the host's speed since its calibration."""
        return Agreement.of(list(self.plans))

    @property
    def num_failed(self) -> int:
        return sum(r.status == "failed" for r in self.plans)

    def to_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "plans"}
        raw = self.agreement_at_profile_speed
        out.update(num_plans=len(self.plans), num_failed=self.num_failed, **self.agreement.to_dict(),
                   predictions_at_host_speed=self.at_host_speed, mape_at_profile_speed=raw.mape,
                   max_error_at_profile_speed=raw.max_error,
                   plans=[{**r.to_dict(), HOST_SPEED_PREDICTION: r.predicted_step_time_s * self.host_speed_for(r)}
                          for r in self.plans])
        return out

    @classmethod
    def from_dict(cls, data: object, *, what: str = "measurements") -> "ValidationReport":
        if not isinstance(data, dict) or "plans" not in data:
            raise PlannerError(f"{what}: expected a `planner validate --out` report")
        # Derived keys, and those of older reports (mape_at_calibration_speed), are not read back.
        derived = {"num_plans", "num_failed", "mape_at_calibration_speed", "predictions_at_host_speed",
                   "mape_at_profile_speed", "max_error_at_profile_speed",
                   *(f.name for f in dataclasses.fields(Agreement))}
        fields = {k: v for k, v in data.items() if k not in derived}
        if isinstance(fields["plans"], list):  # each row's derived keys too (what `planner validate --out` writes)
            skip = (*ValidationRow.DERIVED, HOST_SPEED_PREDICTION)
            fields["plans"] = [{k: v for k, v in row.items() if k not in skip}
                               if isinstance(row, dict) else row for row in fields["plans"]]
        return dataclass_from_dict(cls, fields, what=what)


@dataclass(frozen=True)
class CalibrationResult:
    """What `planner calibrate` fitted, and the agreement on the fitted and the held-out plans before
    and after."""

    calibration: dict[str, float]
    fit_labels: tuple[str, ...]
    held_out_labels: tuple[str, ...]
    fit_before: Agreement
    fit_after: Agreement
    held_out_before: Agreement
    held_out_after: Agreement
    rms_relative_error: float  # of the fitted plans after the fit

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class TuneCalibration:
    """tune's self-calibration: how many plans it timed, what it fitted, their error before and after."""

    num_plans: int
    parameters: dict[str, float]
    mape_before: float
    mape_after: float
    at_bounds: tuple[str, ...] = ()  # parameters the fit left at a bound (planner.calibrate.parameters_at_bounds)
    # The fitted compute_time_scale over the one the profile's layer probe fitted (None: no probe value).
    compute_scale_of_probe: float | None = None
    # What the fit minimises: the root mean square of (predicted - measured) / measured over the timed plans,
    # before and after (the mean |error| above can rise while this falls).
    rms_before: float | None = None
    rms_after: float | None = None


@dataclass(frozen=True)
class HostCheck:
    """tune's host check (planner/tune.host_check): the winner timed again interleaved with calibration plans
    in one batched run, so the host's speed now against when the profile was fitted (`factor`, measured now /
    measured then of the reference plans, median over them) and the winner's time are from one window."""

    factor: float
    winner_step_time_s: float  # the winner's median step in the interleaved run
    references: tuple[str, ...]  # the calibration plans re-timed (Plan.describe())
    reference_ratios: tuple[float, ...]  # each one's measured now / measured then


@dataclass(frozen=True)
class TuneReport:
    """`planner tune`: the profile used, the plan chosen, measured beside predicted, and the time taken."""

    profile: str
    profile_reused: bool
    calibrated_from_runs: int
    calibration: TuneCalibration | None
    plan: Plan
    runner_up: tuple[str, ...]
    predicted: dict  # cost_models.estimate.Estimate.to_dict()
    measured: RunSummary
    losses: tuple[float, ...]
    times_s: dict[str, float] = field(default_factory=dict)  # profile, calibrate, search, run, total
    step_times_s: tuple[float, ...] = ()  # every timed step of the run (the first, allocating one dropped)
    host_check: HostCheck | None = None  # None where no calibration plan at these settings could be re-timed
    host_check_error: str | None = None  # why the host check failed, where it did (the run's results stand)

    @property
    def step_time_ratio(self) -> float:
        """The headline: measured / predicted at the host's speed now where the host check measured it
        (step_time_ratio_at_host_speed), else the run's own at the profile's speed."""
        at_host = self.step_time_ratio_at_host_speed
        return self.step_time_ratio_at_profile_speed if at_host is None else at_host

    @property
    def step_time_ratio_at_profile_speed(self) -> float:
        """The run's own median step over the prediction as the profile prices it."""
        return self.measured.median_step_time_s / self.predicted["step_time_s"]

    @property
    def step_time_ratio_quartiles(self) -> tuple[float, float] | None:
        """The first and third quartiles of measured / predicted (at the profile's speed) over the run's steps
        (its spread), or None with fewer than MIN_SAMPLES_FOR_SPREAD steps."""
        if len(self.step_times_s) < MIN_SAMPLES_FOR_SPREAD:
            return None
        q1, _, q3 = statistics.quantiles(self.step_times_s, n=4)
        return (q1 / self.predicted["step_time_s"], q3 / self.predicted["step_time_s"])

    @property
    def step_time_ratio_at_host_speed(self) -> float | None:
        """The winner's interleaved step over the prediction at the host's speed now (prediction x factor):
        what the cost model gets wrong once the host's drift since the calibration is taken out."""
        check = self.host_check
        return None if check is None else check.winner_step_time_s / (self.predicted["step_time_s"] * check.factor)

    @property
    def memory_ratio(self) -> float:
        return self.measured.peak_memory_bytes / self.predicted["peak_memory_bytes"]

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out.update(plan=self.plan.to_dict(), describe=self.plan.describe(), step_time_ratio=self.step_time_ratio,
                   step_time_ratio_quartiles=self.step_time_ratio_quartiles, memory_ratio=self.memory_ratio,
                   step_time_ratio_at_host_speed=self.step_time_ratio_at_host_speed,
                   step_time_ratio_at_profile_speed=self.step_time_ratio_at_profile_speed)
        return out
