"""`planner validate`: run a spread of plans for real and measure how well the cost model predicts them.

    planner validate --nproc 4 --hardware profile.json --out validate.json --png validate.png
    planner validate --nproc 2 --top 1 --max-plans 3 --steps 4 --format json

The plans are the search's top K on the given hardware plus a deliberate spread (DP with several
micro-batch sizes, ZeRO-1/2/3, TP with and without sequence parallelism, PP under 1F1B, GPipe and
interleaving, recomputation, commshift, context parallelism: ring and all-to-all), each run with `planner run`'s library (runners.launch.launch)
on this node. Every plan runs once per round and the rounds interleave the plans, so a burst of load
from another process lands on one run of several plans rather than on every run of one plan; a plan's
measured step time is the median over rounds of each run's median step time (the first step, which
allocates, is dropped by the runner). A run that fails is reported with its reason and the others go on.

On a loaded host the runs' medians are noisy (start-up dominates a short run, and a burst of load lands
on one plan's run). `--timing-rounds R` adds one batched timing run (`measure_step_times_batched`):
every plan that ran keeps its trainer in one set of processes and the plans take turns, a few steps
each, R times over, so every plan is sampled across the whole window; the measured step time is then
the median of those steps (memory still comes from the per-plan runs).

The host's speed: a shared host runs the same plan 0.7-1.5x as fast from one minute to the next, and a
profile's calibration is fitted at the speed of its minutes. So the batched run also times up to
HOST_REFERENCE_PLANS of the plans the calibration timed (the validated plans it also timed, then its others,
each at its own model and batch): their measured now / measured then, side by side with the validated plans
in one window, is the host's speed against the profile's, and each prediction is taken at that speed (the
median over the references, a reference's own time left out of its own). With fewer than two references
(an uncalibrated profile, another process count) the predictions stay at the profile's speed. The report
gives the MAPE both ways (mape_at_profile_speed); the ranking metrics are the cost model's own.

Agreement metrics (all over the plans that ran):
  mape          mean of |predicted - measured| / measured (predicted at the host's speed, above)
  max_error     the largest of those
  kendall_tau   Kendall's tau-b between predicted and measured step times (1: the model orders the
                plans exactly as reality does; Kendall 1938, with Knight's tie correction)
  regret        measured time of the plan the model ranks first over the best measured time, minus 1
                (the search's winner when it ran: it is the predicted-fastest plan of the whole space)
"""

from __future__ import annotations

import json
import statistics
import warnings
from dataclasses import dataclass, field
from typing import Callable

from specs.errors import PlannerError
from specs.problem import Problem, make_problem
from planner.inputs import plan_from_options
from specs.plan import Plan
from planner.reports import ValidationReport, ValidationRow

# Deliberately different plans, most informative first (a --max-plans cut keeps the first ones): each
# knob the cost model prices differently appears at least once.
SPREAD: tuple[tuple[str, dict], ...] = (
    ("dp mb1", {}),
    ("tp2", {"tp": 2}),
    ("pp2 1f1b", {"pp": 2}),
    ("zero3", {"zero": 3}),
    ("dp mb2", {"micro_batch": 2}),
    ("zero1", {"zero": 1}),
    ("pp2 gpipe", {"pp": 2, "schedule": "gpipe"}),
    ("tp4", {"tp": 4}),
    ("zero2", {"zero": 2}),
    # Context parallelism: dp2 x cp2 on 4 processes (cp2 alone on 2), the ring's p2p steps and the
    # sequence split; cp4 (4 processes) its longest ring; the all-to-all kind further down.
    ("cp2", {"cp": 2}),
    ("pp4 1f1b", {"pp": 4}),
    ("dp mb4", {"micro_batch": 4}),
    ("tp2 sp", {"tp": 2, "sequence_parallel": True}),
    ("pp2 interleaved v2", {"pp": 2, "virtual_stages": 2}),
    ("zero3 mb2", {"zero": 3, "micro_batch": 2}),
    ("recompute full", {"recompute": "full"}),
    ("cp4", {"cp": 4}),
    ("tp2 pp2", {"tp": 2, "pp": 2}),
    ("pp2 commshift", {"pp": 2, "commshift": True}),
    ("zero1 mb2", {"zero": 1, "micro_batch": 2}),
    ("tp2 mb2", {"tp": 2, "micro_batch": 2}),
    ("recompute selective", {"recompute": "selective"}),
    ("pp2 mb2", {"pp": 2, "micro_batch": 2}),
    ("tp2 zero3", {"tp": 2, "zero": 3}),
    ("pp2 zero1", {"pp": 2, "zero": 1}),
    ("zero2 mb4", {"zero": 2, "micro_batch": 4}),
    ("pp4 gpipe", {"pp": 4, "schedule": "gpipe"}),
    ("tp2 recompute full", {"tp": 2, "recompute": "full"}),
    ("cp2 a2a", {"cp": 2, "cp_kind": "all-to-all"}),
    # MoE models only (a dense model refuses ep and etp, so these are skipped for it): experts over EP,
    # alone and with the sharding, TP + SP, pipeline and context parallelism the engine folds them with.
    ("ep2", {"ep": 2}),
    ("ep4", {"ep": 4}),
    ("ep2 zero3", {"ep": 2, "zero": 3}),
    ("ep2 tp2 sp", {"ep": 2, "tp": 2, "sequence_parallel": True}),
    ("ep2 pp2", {"ep": 2, "pp": 2}),
    ("ep2 recompute full", {"ep": 2, "recompute": "full"}),
    ("ep2 cp2", {"ep": 2, "cp": 2}),
    # Expert TP: every expert's width over 2 ranks, its rows gathered and its outputs reduce-scattered.
    ("etp2", {"etp": 2}),
    ("ep2 etp2", {"ep": 2, "etp": 2}),
)


@dataclass(frozen=True)
class ValidateSettings:
    """What to validate on: the model, the job, the hardware the predictions use, and how to measure."""

    model: str = "tiny"
    hardware: str | None = None  # None: this machine's profile for nproc processes (planner.machine)
    nproc: int | None = None  # None: planner.machine.default_nproc()
    # Twice run's and tune's 8: enough sequences for the spread's micro-batch sizes on 4 processes.
    global_batch: int = 16
    seq_len: int = 64
    precision: str | None = None  # None: bf16 on a GPU, fp32 on CPU (planner.machine.local_precision)
    steps: int = 8
    rounds: int = 1
    top_k: int = 3
    spread: bool = True
    max_plans: int | None = None
    # Interleaved rounds of the batched timing run: None (the default) adds rounds until the top pick and
    # the fastest measured plan are separable or MAX_TIMING_ROUNDS is reached (time_until_separable);
    # 0: time each plan from its own runs.
    timing_rounds: int | None = None
    timing_steps: int = 3
    seed: int = 0
    timeout_s: float = 300.0
    # Name prefix of an emulated cluster (`planner cluster up`) to run every plan on, or None: nproc local
    # processes. On a cluster its nodes x processes per node replace nproc.
    cluster: str | None = None

    def __post_init__(self) -> None:
        from planner.machine import default_nproc, local_hardware, local_precision

        object.__setattr__(self, "nproc", default_nproc() if self.nproc is None else self.nproc)
        if self.hardware is None and self.cluster is not None:
            # The emulated nodes share this host: its profile for that many processes, whose links are
            # loopback ones; `planner profile --cluster` measures the shaped inter-node link too.
            warnings.warn("--cluster without --hardware prices with this host's profile, whose inter-node link "
                          "is not the emulated one; `planner profile --cluster` measures it", stacklevel=2)
        # On a GPU the runs use CUDA and NCCL (runners.launch.pick_device): price them as such.
        object.__setattr__(self, "hardware", self.hardware or local_hardware(self.topology()[0]))
        object.__setattr__(self, "precision", self.precision or local_precision())
        for name in ("nproc", "global_batch", "seq_len", "steps", "rounds"):
            if getattr(self, name) < 1:
                raise PlannerError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.steps < 2:
            raise PlannerError(f"--steps must be at least 2 (the first step is a warm-up), got {self.steps}")
        if (self.timing_rounds is not None and self.timing_rounds < 0) or self.timing_steps < 1:
            raise PlannerError(f"--timing-rounds must be at least 0, got {self.timing_rounds}")
        if self.top_k < 0 or (self.max_plans is not None and self.max_plans < 1):
            raise PlannerError(f"--top must be at least 0 and --max-plans at least 1, got {self.top_k} and {self.max_plans}")

    def topology(self) -> tuple[int, int]:
        """(ranks, ranks per node): the emulated cluster's, or nproc local processes as one node."""
        return self.where().topology()

    def where(self):
        """Where every plan runs (runners.launch.Where)."""
        from runners.launch import Where

        return Where(nproc=self.nproc, cluster=self.cluster)

    def problem(self) -> Problem:
        world, per_node = self.topology()
        return make_problem(model=self.model, hardware=self.hardware, gpus=world, gpus_per_node=per_node,
                            global_batch=self.global_batch, seq_len=self.seq_len, precision=self.precision)


@dataclass(frozen=True)
class PlanEntry:
    label: str
    source: str  # "search", "spread" or "reference" (timed for the host's speed only, not a row)
    plan: Plan
    problem: Problem | None = None  # its own model and job (a reference's); None: the validation's
    reference: object | None = None  # a reference's specs.hardware.CalibrationRun


def candidate_plans(problem: Problem, *, top_k: int, spread: bool = True, max_plans: int | None = None) -> list[PlanEntry]:
    """The search's top K (fitting plans) and then the spread, without duplicates, at most `max_plans`.

    A spread plan the problem cannot hold (tp above the heads, more stages than layers, a batch that
    does not divide) is skipped; the runner's own limits (tied embeddings across stages) too."""
    from planner.search import SearchOptions, search

    entries: list[PlanEntry] = []
    seen: set[Plan] = set()
    if top_k:
        result = search(problem, options=SearchOptions(top_k=top_k))
        for i, c in enumerate([c for c in result.candidates if c.estimate.fits][:top_k], 1):
            entries.append(PlanEntry(f"search #{i}", "search", c.plan))
            seen.add(c.plan)
    for label, flags in SPREAD if spread else ():
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # a knob without effect here is skipped below, not warned about
                plan = plan_from_options(flags, problem)
        except (PlannerError, ValueError):
            continue
        if plan.commshift and not (plan.pp > 1 and plan.dp_cp > 1):
            continue
        if plan in seen or (problem.model.tied_embeddings and plan.pp > 1):
            continue
        seen.add(plan)
        entries.append(PlanEntry(label, "spread", plan))
    if not entries:
        raise PlannerError("no plan to validate: give --top at least 1 or keep the spread")
    return entries[:max_plans] if max_plans else entries


# --- measuring ------------------------------------------------------------------------------------
@dataclass
class Measurement:
    """One plan's runs: per-round median step times and peak memory, or why it failed."""

    entry: PlanEntry
    step_times_s: list[float] = field(default_factory=list)  # per run: its median step
    peak_memory_bytes: list[int] = field(default_factory=list)
    error: str | None = None
    batched_step_times_s: list[float] = field(default_factory=list)  # every step of the batched timing run


Progress = Callable[[int, int, str], None]


def measure(entries: list[PlanEntry], settings: ValidateSettings, *, progress: Progress | None = None,
            runner: Callable | None = None, timer: Callable | None = None,
            references: list[PlanEntry] = ()) -> list[Measurement]:
    """Run every plan `settings.rounds` times, interleaved; a failed plan is not retried; then time the
    plans that ran in the batched timing run (`settings.timing_rounds`), the `references` beside them
    (their measurements follow the entries' in the result; they have no runs of their own).

    `runner(cfg, where=...) -> RunMetrics` defaults to runners.launch.launch, and `timer(entries, settings,
    rounds=, steps_per_round=, progress=)` to measure_step_times_batched (tests may pass others)."""
    from runners.config import RunConfig
    from runners.launch import RunFailed, launch

    run = runner or launch
    problem = settings.problem()
    _, per_node = settings.topology()
    results = [Measurement(e) for e in entries]
    total, done = settings.rounds * len(entries), 0
    for round_index in range(settings.rounds):
        for m in results:
            done += 1
            if progress is not None:
                progress(done, total, f"round {round_index + 1}: {m.entry.label} ({m.entry.plan.describe()})")
            if m.error is not None:
                continue
            cfg = RunConfig(plan=m.entry.plan, model=problem.model, job=problem.job, steps=settings.steps,
                            seed=settings.seed, ranks_per_node=per_node, timeout_s=settings.timeout_s)
            try:
                metrics = run(cfg, where=settings.where())
            except (RunFailed, PlannerError, OSError) as exc:
                m.error = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                continue
            if metrics is None:
                m.error = "the run wrote no metrics"
                continue
            m.step_times_s.append(float(metrics.summary.median_step_time_s))
            m.peak_memory_bytes.append(int(metrics.summary.peak_memory_bytes))
    ok = [m for m in results if m.error is None]
    refs = [Measurement(e) for e in references]
    timer = timer or measure_step_times_batched
    try:
        _time_batched(ok + refs, settings, progress=progress, timer=timer)
    except RunFailed:
        if not refs:
            raise
        # A reference is there for the host's speed only: one that no longer runs (a profile from an older
        # version) must not cost the validation, which is timed again without them.
        warnings.warn("the batched timing failed with the calibration's reference plans beside the validated "
                      "ones; timed without them (predictions at the profile's speed)", stacklevel=2)
        for m in ok:
            m.batched_step_times_s = []
        refs = []
        _time_batched(ok, settings, progress=progress, timer=timer)
    return results + [m for m in refs if m.batched_step_times_s]


def _time_batched(ok: list[Measurement], settings: ValidateSettings, *, progress: Progress | None,
                  timer: Callable) -> None:
    """The batched timing of `ok` (validated plans, then references): adaptive or a fixed number of rounds."""
    compared = [m for m in ok if m.entry.source != "reference"]
    if settings.timing_rounds is None and len(compared) > 1:
        time_until_separable(ok, settings, progress=progress, timer=timer)
    elif settings.timing_rounds and compared:
        times = timer([m.entry for m in ok], settings, rounds=settings.timing_rounds,
                      steps_per_round=settings.timing_steps, progress=progress)
        for m, samples in zip(ok, times):
            m.batched_step_times_s = list(samples)


# The adaptive batched timing: rounds per launch, and the most rounds in all.
TIMING_ROUNDS_PER_LAUNCH = 4
MAX_TIMING_ROUNDS = 16


def time_until_separable(ok: list[Measurement], settings: ValidateSettings, *, progress: Progress | None = None,
                         timer: Callable | None = None) -> int:
    """Time the plans in batched, interleaved launches of TIMING_ROUNDS_PER_LAUNCH rounds, adding launches
    until the cost model's top pick and the fastest measured plan are the same plan or separable (their
    interquartile ranges apart; planner.reports.ValidationRow.separable_from), or MAX_TIMING_ROUNDS are
    done; every step lands in the measurements' batched_step_times_s (references' too, never compared).
    Returns the rounds run."""
    from cost_models.estimate import estimate

    problem = settings.problem()
    compared = [i for i, m in enumerate(ok) if m.entry.source != "reference"]
    predicted = {i: estimate(ok[i].entry.plan, model=problem.model, cluster=problem.cluster,
                             job=problem.job).step_time_s for i in compared}
    top = min(compared, key=predicted.__getitem__)
    rounds = 0
    while rounds < MAX_TIMING_ROUNDS:
        batch = min(TIMING_ROUNDS_PER_LAUNCH, MAX_TIMING_ROUNDS - rounds)
        times = (timer or measure_step_times_batched)([m.entry for m in ok], settings, rounds=batch,
                                                      steps_per_round=settings.timing_steps, progress=progress)
        for m, samples in zip(ok, times):
            m.batched_step_times_s.extend(samples)
        rounds += batch
        rows = [_timing_row(m) for m in ok]
        best = min(compared, key=lambda i: rows[i].measured_step_time_s)
        if best == top or rows[top].separable_from(rows[best]):
            break
    return rounds


def _timing_row(m: Measurement) -> ValidationRow:
    """A row carrying only what separability needs: the batched samples and their median."""
    return ValidationRow(label=m.entry.label, source=m.entry.source, plan=m.entry.plan, status="ok", error=None,
                         predicted_step_time_s=0.0, predicted_peak_memory_bytes=0,
                         measured_step_time_s=statistics.median(m.batched_step_times_s),
                         batched_step_times_s=tuple(m.batched_step_times_s))


# --- batched timing -------------------------------------------------------------------------------
def measure_step_times_batched(entries: list[PlanEntry], settings: ValidateSettings, *, rounds: int,
                               steps_per_round: int = 3, progress: Progress | None = None) -> list[list[float]]:
    """Per plan, every timed step (each the slowest rank's wall time) of one batched, interleaved run
    (runners/timing.py). Raises RunFailed (with the failing rank's error) if it fails."""
    from runners.config import RunConfig, TimingResult, TimingSpec
    from runners.launch import run_workers

    problem = settings.problem()
    _, per_node = settings.topology()
    configs = tuple(RunConfig(plan=e.plan, model=(e.problem or problem).model, job=(e.problem or problem).job,
                              steps=1, seed=settings.seed, ranks_per_node=per_node, timeout_s=settings.timeout_s)
                    for e in entries)
    spec = TimingSpec(configs=configs, labels=tuple(e.label for e in entries), rounds=rounds,
                      steps_per_round=steps_per_round)

    def on_event(event: dict) -> None:
        if event.get("kind") == "progress" and progress is not None:
            progress(event["done"], event["total"], event["label"])

    result = run_workers("runners.timing", spec.to_dict(), where=settings.where(), on_event=on_event)
    return [list(t) for t in TimingResult.from_dict(result).step_times_s]


# --- comparing ------------------------------------------------------------------------------------
def plan_row(m: Measurement, problem: Problem) -> ValidationRow:
    """A report row: the plan, its prediction on `problem`'s hardware, and what was measured."""
    from cost_models.estimate import estimate

    est = estimate(m.entry.plan, model=problem.model, cluster=problem.cluster, job=problem.job)
    row = ValidationRow(label=m.entry.label, source=m.entry.source, plan=m.entry.plan,
                        status="failed" if m.error is not None else "ok", error=m.error,
                        predicted_step_time_s=est.step_time_s, predicted_peak_memory_bytes=est.peak_memory_bytes,
                        rounds_step_time_s=tuple(m.step_times_s), batched_step_times_s=tuple(m.batched_step_times_s))
    if m.error is None and m.step_times_s:
        # The batched run's steps when there is one (many interleaved samples), else the runs' medians.
        row = row.replace(measured_step_time_s=statistics.median(m.batched_step_times_s or m.step_times_s),
                          measured_peak_memory_bytes=int(statistics.median(m.peak_memory_bytes)))
    return row


def repredict(rows: list[ValidationRow], problem: Problem) -> list[ValidationRow]:
    """The same measured rows priced again on `problem` (e.g. with calibrated hardware)."""
    from cost_models.estimate import estimate

    out = []
    for row in rows:
        est = estimate(row.plan, model=problem.model, cluster=problem.cluster, job=problem.job)
        out.append(row.replace(predicted_step_time_s=est.step_time_s, predicted_peak_memory_bytes=est.peak_memory_bytes))
    return out


def plan_key(plan: dict) -> str:
    """A plan's identity among a profile's calibration runs (Plan.to_dict(), keys sorted)."""
    return json.dumps(plan, sort_keys=True)


def calibration_step_times(hardware, *, model: str, global_batch: int, seq_len: int, precision: str,
                           processes: int) -> dict[str, float]:
    """plan_key -> measured step time of the plans the profile's calibration timed at these settings."""
    return {plan_key(run.plan): run.step_time_s for run in hardware.calibration_runs
            if (run.model, run.global_batch, run.seq_len, run.precision, run.processes) == (
                model, global_batch, seq_len, precision, processes) and run.step_time_s > 0}


# The host's speed reference (planner/reports.ValidationReport.host_speed_ratios): the profile's calibration
# plans timed again beside the validated plans, in the same interleaved run, at most this many (those the
# validation times anyway first, then the calibration's other plans at this process count, its own batch).
HOST_REFERENCE_PLANS = 6


def reference_entries(entries: list[PlanEntry], settings: ValidateSettings) -> list[PlanEntry]:
    """The calibration plans to time beside `entries` as the host's speed reference, beyond those `entries`
    hold at the validation's own settings (module constant HOST_REFERENCE_PLANS). A run whose model or plan
    no longer resolves is skipped."""
    world, per_node = settings.topology()
    here = (settings.model, settings.global_batch, settings.seq_len, settings.precision, world)
    validated = {plan_key(e.plan.to_dict()) for e in entries}
    runs = [r for r in settings.problem().cluster.hardware.calibration_runs
            if r.processes == world and r.step_time_s > 0]
    matched = [r for r in runs if (r.model, r.global_batch, r.seq_len, r.precision, r.processes) == here
               and plan_key(r.plan) in validated]
    others = sorted((r for r in runs if r not in matched),
                    key=lambda r: (r.model != settings.model, r.seq_len != settings.seq_len,
                                   r.precision != settings.precision))
    out: list[PlanEntry] = []
    for run in others[:max(0, HOST_REFERENCE_PLANS - len(matched))]:
        try:
            problem = make_problem(model=run.model, hardware=settings.hardware, gpus=world, gpus_per_node=per_node,
                                   global_batch=run.global_batch, seq_len=run.seq_len, precision=run.precision)
            plan = Plan.from_dict(run.plan)
        except (PlannerError, ValueError, TypeError, KeyError):
            continue
        out.append(PlanEntry(f"reference {len(out) + 1} ({run.model}, batch {run.global_batch})", "reference", plan,
                             problem=problem, reference=run))
    return out


def host_speed_ratios(measurements: list[Measurement], settings: ValidateSettings) -> tuple[tuple[str, float], ...]:
    """(label, measured now / measured then) of every measurement that ran a plan the profile's calibration
    timed: a reference at its own settings, a validated plan at the validation's. Above 1 the host runs
    slower than when the profile was fitted (other load, a slower clock)."""
    world = settings.topology()[0]
    then = calibration_step_times(settings.problem().cluster.hardware, model=settings.model,
                                  global_batch=settings.global_batch, seq_len=settings.seq_len,
                                  precision=settings.precision, processes=world)
    out = []
    for m in measurements:
        samples = m.batched_step_times_s or m.step_times_s
        if m.error is not None or not samples:
            continue
        reference = (m.entry.reference.step_time_s if m.entry.reference is not None
                     else then.get(plan_key(m.entry.plan.to_dict())))
        if reference is not None:
            out.append((m.entry.label, statistics.median(samples) / reference))
    return tuple(out)


def build_report(measurements: list[Measurement], settings: ValidateSettings) -> ValidationReport:
    problem = settings.problem()
    rows = [plan_row(m, problem) for m in measurements if m.entry.source != "reference"]
    ratios = host_speed_ratios(measurements, settings)
    return ValidationReport(
        model=settings.model, hardware=settings.hardware, hardware_name=problem.cluster.hardware.name,
        calibration=dict(problem.cluster.hardware.calibration), nproc=settings.topology()[0], cluster=settings.cluster,
        global_batch=settings.global_batch, seq_len=settings.seq_len, precision=settings.precision,
        steps=settings.steps, rounds=settings.rounds,
        # The rounds the batched timing ran (adaptive by default): each round times timing_steps steps.
        timing_rounds=max((len(m.batched_step_times_s) for m in measurements), default=0) // settings.timing_steps,
        plans=tuple(rows), host_speed_factor=statistics.median(r for _, r in ratios) if ratios else None,
        host_speed_plans=len(ratios), host_speed_ratios=ratios)


def validate(settings: ValidateSettings, *, progress: Progress | None = None,
             runner: Callable | None = None, timer: Callable | None = None) -> ValidationReport:
    """Pick the plans, run them, and return the report (see the module docstring)."""
    entries = candidate_plans(settings.problem(), top_k=settings.top_k, spread=settings.spread,
                              max_plans=settings.max_plans)
    references = reference_entries(entries, settings) if settings.timing_rounds != 0 else []
    return build_report(measure(entries, settings, progress=progress, runner=runner, timer=timer,
                                references=references), settings)


# --- the picture ----------------------------------------------------------------------------------
def write_scatter_png(report: ValidationReport, path: str, *, title: str | None = None) -> None:
    """Predicted against measured step time (log-log, with the y = x line and a +-10% band) and peak
    memory, one labelled point per plan that ran."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in report.plans if r.ok]
    speed = getattr(report, "host_speed_for", lambda row: 1.0)  # step times at the host's speed now, where measured
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(13, 6))
    panels = ((ax_t, "step_time_s", 1e3, "step time (ms)"), (ax_m, "peak_memory_bytes", 2.0**-20, "peak memory (MiB)"))
    for ax, key, scale, name in panels:
        xs = [getattr(r, f"measured_{key}") * scale for r in ok]
        ys = [getattr(r, f"predicted_{key}") * scale * (speed(r) if key == "step_time_s" else 1.0) for r in ok]
        colors = ["tab:red" if r.source == "search" else "tab:blue" for r in ok]
        ax.scatter(xs, ys, c=colors, s=28, zorder=3)
        for r, x, y in zip(ok, xs, ys):
            ax.annotate(r.label, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
        if xs:
            lo, hi = min(xs + ys) / 1.3, max(xs + ys) * 1.3
            ax.plot([lo, hi], [lo, hi], "k-", lw=1, label="predicted = measured")
            ax.fill_between([lo, hi], [lo * 0.9, hi * 0.9], [lo * 1.1, hi * 1.1], color="0.85", label="+-10%")
            ax.set_xlim(lo, hi)
            ax.set_ylim(lo, hi)
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.legend(loc="upper left", fontsize=8)
        ax.set_xlabel(f"measured {name}")
        ax.set_ylabel(f"predicted {name}")
        ax.grid(True, which="both", alpha=0.3)

    def pct(v):
        return "n/a" if v is None else f"{v:.1%}"

    agree = report.agreement
    tau = agree.kendall_tau
    ax_t.set_title(f"step time: MAPE {pct(agree.mape)}, max {pct(agree.max_error)}, "
                   f"tau {'n/a' if tau is None else f'{tau:.2f}'}, regret {pct(agree.regret)}", fontsize=9)
    ax_m.set_title(f"peak memory per rank: MAPE {pct(agree.memory_mape)}", fontsize=9)
    fig.suptitle(title or f"{report.model} on {report.nproc} processes, hardware {report.hardware_name} "
                          f"(red: search's top plans)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
