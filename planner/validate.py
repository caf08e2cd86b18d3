"""`planner validate`: run a spread of plans for real and measure how well the cost model predicts them.

    planner validate --nproc 4 --hardware profile.json --out validate.json --png validate.png
    planner validate --nproc 2 --top 1 --max-plans 3 --steps 4 --format json

The plans are the search's top K on the given hardware plus a deliberate spread (DP with several
micro-batch sizes, ZeRO-1/2/3, TP with and without sequence parallelism, PP under 1F1B, GPipe and
interleaving, recomputation, commshift), each run with `planner run`'s library (runners.launch.launch)
on this node. Every plan runs once per round and the rounds interleave the plans, so a burst of load
from another process lands on one run of several plans rather than on every run of one plan; a plan's
measured step time is the median over rounds of each run's median step time (the first step, which
allocates, is dropped by the runner). A run that fails is reported with its reason and the others go on.

On a loaded host the runs' medians are noisy (start-up dominates a short run, and a burst of load lands
on one plan's run). `--timing-rounds R` adds one batched timing run (`measure_step_times_batched`):
every plan that ran keeps its trainer in one set of processes and the plans take turns, a few steps
each, R times over, so every plan is sampled across the whole window; the measured step time is then
the median of those steps (memory still comes from the per-plan runs).

Agreement metrics (all over the plans that ran):
  mape          mean of |predicted - measured| / measured
  max_error     the largest of those
  kendall_tau   Kendall's tau-b between predicted and measured step times (1: the model orders the
                plans exactly as reality does; Kendall 1938, with Knight's tie correction)
  regret        measured time of the plan the model ranks first over the best measured time, minus 1
                (the search's winner when it ran: it is the predicted-fastest plan of the whole space)
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import warnings
from dataclasses import dataclass, field
from typing import Callable

from specs.errors import PlannerError
from specs.problem import Problem, make_problem
from planner.inputs import PlanFlags, plan_from_flags
from specs.plan import Plan

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
    ("pp4 1f1b", {"pp": 4}),
    ("dp mb4", {"micro_batch": 4}),
    ("tp2 sp", {"tp": 2, "sequence_parallel": True}),
    ("pp2 interleaved v2", {"pp": 2, "virtual_stages": 2}),
    ("zero3 mb2", {"zero": 3, "micro_batch": 2}),
    ("recompute full", {"recompute": "full"}),
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
)


@dataclass(frozen=True)
class ValidateSettings:
    """What to validate on: the model, the job, the hardware the predictions use, and how to measure."""

    model: str = "tiny"
    hardware: str = "cpu"
    nproc: int = 4
    global_batch: int = 16
    seq_len: int = 64
    precision: str = "fp32"
    steps: int = 8
    rounds: int = 1
    top_k: int = 3
    spread: bool = True
    max_plans: int | None = None
    # Interleaved rounds of the batched timing run (0: time each plan from its own runs).
    timing_rounds: int = 0
    timing_steps: int = 3
    seed: int = 0
    timeout_s: float = 300.0
    # Name prefix of an emulated cluster (`planner cluster up`) to run every plan on, or None: nproc local
    # processes. On a cluster its nodes x processes per node replace nproc.
    cluster: str | None = None

    def __post_init__(self) -> None:
        for name in ("nproc", "global_batch", "seq_len", "steps", "rounds"):
            if getattr(self, name) < 1:
                raise PlannerError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.steps < 2:
            raise PlannerError(f"--steps must be at least 2 (the first step is a warm-up), got {self.steps}")
        if self.timing_rounds < 0 or self.timing_steps < 1:
            raise PlannerError(f"--timing-rounds must be at least 0, got {self.timing_rounds}")
        if self.top_k < 0 or (self.max_plans is not None and self.max_plans < 1):
            raise PlannerError(f"--top must be at least 0 and --max-plans at least 1, got {self.top_k} and {self.max_plans}")

    def topology(self) -> tuple[int, int]:
        """(ranks, ranks per node): the emulated cluster's, or nproc local processes as one node."""
        if self.cluster is None:
            return self.nproc, self.nproc
        from runners.netns_cluster import load_state

        state = load_state(self.cluster)
        return state.num_nodes * state.procs_per_node, state.procs_per_node

    def problem(self) -> Problem:
        world, per_node = self.topology()
        return make_problem(model=self.model, hardware=self.hardware, gpus=world, gpus_per_node=per_node,
                            global_batch=self.global_batch, seq_len=self.seq_len, precision=self.precision)


@dataclass(frozen=True)
class PlanEntry:
    label: str
    source: str  # "search" or "spread"
    plan: Plan


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
                plan = plan_from_flags(PlanFlags(**flags), problem)
        except (PlannerError, ValueError):
            continue
        if plan.commshift and not (plan.pp > 1 and plan.dp > 1):
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
            runner: Callable | None = None) -> list[Measurement]:
    """Run every plan `settings.rounds` times, interleaved; a failed plan is not retried.

    `runner(cfg, nproc=...) -> metrics` defaults to runners.launch.launch (tests may pass another)."""
    from runners.launch import RunFailed, launch, launch_on_emulated_cluster
    from runners.train import RunConfig

    if runner is not None:
        run = runner
    elif settings.cluster is not None:
        run = lambda cfg, nproc: launch_on_emulated_cluster(cfg, prefix=settings.cluster)  # noqa: E731
    else:
        run = lambda cfg, nproc: launch(cfg, nproc=nproc)  # noqa: E731
    problem = settings.problem()
    world, per_node = settings.topology()
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
                            seed=settings.seed, ranks_per_node=per_node, hardware=settings.hardware,
                            timeout_s=settings.timeout_s)
            try:
                metrics = run(cfg, nproc=world)
            except (RunFailed, PlannerError, OSError) as exc:
                m.error = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                continue
            if metrics is None:
                m.error = "the run wrote no metrics"
                continue
            m.step_times_s.append(float(metrics["summary"]["median_step_time_s"]))
            m.peak_memory_bytes.append(int(metrics["summary"]["peak_memory_bytes"]))
    ok = [m for m in results if m.error is None]
    if settings.timing_rounds and ok:
        times = measure_step_times_batched([m.entry for m in ok], settings, rounds=settings.timing_rounds,
                                           steps_per_round=settings.timing_steps, progress=progress)
        for m, samples in zip(ok, times):
            m.batched_step_times_s = list(samples)
    return results


# --- batched timing -------------------------------------------------------------------------------
# One torchrun launch that keeps every plan's trainer alive and cycles through the plans `rounds` times,
# a few steps each: process start-up (most of a short run on a loaded host) is paid once, and each plan
# is sampled across the whole measurement window, so a burst of load from other processes spreads over
# all plans instead of landing on one plan's run. Memory is not measured here (every trainer lives in
# the same processes); it comes from the per-plan runs.
WORKER_MODULE = "planner.validate"


def measure_step_times_batched(entries: list[PlanEntry], settings: ValidateSettings, *, rounds: int,
                               steps_per_round: int = 3, progress: Progress | None = None) -> list[list[float]]:
    """Per plan, every timed step (each the slowest rank's wall time) of the interleaved batched run.

    Raises RunFailed (with the failing rank's error) if the batched run fails."""
    import json
    import os
    import signal
    import subprocess
    import sys
    import tempfile
    from collections import deque
    from pathlib import Path

    from specs.jsonio import read_json_file, write_json_atomic
    from runners.launch import RunFailed
    from runners.train import RunConfig

    problem = settings.problem()
    world, per_node = settings.topology()
    configs = [RunConfig(plan=e.plan, model=problem.model, job=problem.job, steps=1, seed=settings.seed,
                         ranks_per_node=per_node, hardware=settings.hardware,
                         timeout_s=settings.timeout_s).to_dict() for e in entries]
    with tempfile.TemporaryDirectory(prefix="planner-validate-") as tmp:
        spec, out = Path(tmp) / "spec.json", Path(tmp) / "times.json"
        write_json_atomic(spec, {"configs": configs, "rounds": rounds, "steps_per_round": steps_per_round,
                                 "labels": [e.label for e in entries]})
        module_argv = ["-m", WORKER_MODULE, "--worker", str(spec), "--out", str(out)]
        tail: deque[str] = deque(maxlen=30)

        def on_line(line: str) -> None:
            if line.startswith(_PROGRESS_PREFIX):
                done, total, label = json.loads(line[len(_PROGRESS_PREFIX):])
                if progress is not None:
                    progress(done, total, label)
            else:
                tail.append(line.rstrip())

        if settings.cluster is not None:
            from runners import netns_cluster as nc
            from runners.launch import cluster_worker_env

            state = nc.load_state(settings.cluster)
            code = nc.launch_on_cluster(
                state, [nc.torchrun_argv(state, node, module_argv) for node in range(state.num_nodes)],
                env=cluster_worker_env(world), on_line=lambda node, line: on_line(line))
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={settings.nproc}",
                   *module_argv]
            env = {**os.environ, "PYTHONUNBUFFERED": "1"}
            env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // settings.nproc)))
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                    start_new_session=True)
            try:
                assert proc.stdout is not None
                for line in proc.stdout:
                    on_line(line)
                code = proc.wait()
            finally:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        if code != 0 or not out.exists():
            raise RunFailed(f"the batched timing run failed (exit code {code}): " + " | ".join(list(tail)[-6:]))
        return read_json_file(out, what="batched timings")["step_times_s"]


_PROGRESS_PREFIX = "PLANNER_VALIDATE "


def _worker(spec_path: str, out_path: str) -> None:
    """One rank of the batched timing run (see measure_step_times_batched)."""
    import datetime
    import json
    import time

    import torch
    import torch.distributed as dist

    from specs.jsonio import read_json_file, write_json_atomic
    from runners.data import make_data, rank_micro_batches
    from runners.train import RunConfig, Trainer

    spec = read_json_file(spec_path, what="validate spec")
    configs = [RunConfig.from_dict(c) for c in spec["configs"]]
    rounds, per_round = spec["rounds"], spec["steps_per_round"]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=max(c.timeout_s for c in configs)))
    rank, device = dist.get_rank(), torch.device("cpu")
    trainers: dict[int, tuple] = {}
    times: list[list[float]] = [[] for _ in configs]
    step_of = [0] * len(configs)
    total = rounds * len(configs)
    for r in range(rounds):
        for i, cfg in enumerate(configs):
            if rank == 0:
                print(_PROGRESS_PREFIX + json.dumps([r * len(configs) + i + 1, total,
                                                     f"round {r + 1}: {spec['labels'][i]}"]), flush=True)
            if i not in trainers:
                torch.manual_seed(cfg.seed)
                trainers[i] = (Trainer(cfg, device=device),
                               make_data(None, vocab_size=cfg.model.vocab_size, seq_len=cfg.job.seq_len, seed=cfg.seed))
            trainer, data = trainers[i]
            # A plan's first step ever allocates its buffers: run it untimed.
            for timed in ([False] if step_of[i] == 0 else []) + [True] * per_round:
                batches = rank_micro_batches(data.global_batch(step_of[i], cfg.job.global_batch), dp=cfg.plan.dp,
                                             dp_rank=trainer.mesh.dp_rank, micro_batch=cfg.plan.micro_batch,
                                             device=device)
                step_of[i] += 1
                dist.barrier()
                start = time.perf_counter()
                trainer.step(batches)
                elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                if timed:
                    times[i].append(elapsed.item())
    if rank == 0:
        write_json_atomic(out_path, {"step_times_s": times})
    dist.barrier()
    dist.destroy_process_group()


# --- comparing ------------------------------------------------------------------------------------
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


def plan_row(m: Measurement, problem: Problem) -> dict:
    """A report row: the plan, its prediction on `problem`'s hardware, what was measured, the errors."""
    from cost_models.estimate import estimate

    est = estimate(m.entry.plan, model=problem.model, cluster=problem.cluster, job=problem.job)
    row = {"label": m.entry.label, "source": m.entry.source, "describe": m.entry.plan.describe(),
           "plan": m.entry.plan.to_dict(), "status": "failed" if m.error is not None else "ok", "error": m.error,
           "predicted_step_time_s": est.step_time_s, "predicted_peak_memory_bytes": est.peak_memory_bytes,
           "measured_step_time_s": None, "measured_peak_memory_bytes": None, "step_time_error": None,
           "memory_error": None, "rounds_step_time_s": list(m.step_times_s),
           "batched_step_times_s": list(m.batched_step_times_s)}
    if m.error is None and m.step_times_s:
        # The batched run's steps when there is one (many interleaved samples), else the runs' medians.
        measured_s = statistics.median(m.batched_step_times_s or m.step_times_s)
        measured_bytes = int(statistics.median(m.peak_memory_bytes))
        row.update(measured_step_time_s=measured_s, measured_peak_memory_bytes=measured_bytes,
                   step_time_error=(est.step_time_s - measured_s) / measured_s,
                   memory_error=(est.peak_memory_bytes - measured_bytes) / measured_bytes)
    return row


def repredict(rows: list[dict], problem: Problem) -> list[dict]:
    """The same measured rows priced again on `problem` (e.g. with calibrated hardware)."""
    out = []
    for row in rows:
        m = Measurement(PlanEntry(row["label"], row["source"], Plan.from_dict(row["plan"])), error=row["error"])
        new = plan_row(m, problem)
        if row["measured_step_time_s"] is not None:
            measured_s, measured_bytes = row["measured_step_time_s"], row["measured_peak_memory_bytes"]
            new.update(measured_step_time_s=measured_s, measured_peak_memory_bytes=measured_bytes,
                       rounds_step_time_s=row.get("rounds_step_time_s", []),
                       batched_step_times_s=row.get("batched_step_times_s", []),
                       step_time_error=(new["predicted_step_time_s"] - measured_s) / measured_s,
                       memory_error=(new["predicted_peak_memory_bytes"] - measured_bytes) / measured_bytes)
        out.append(new)
    return out


def agreement(rows: list[dict]) -> dict:
    """MAPE, max error, Kendall tau and regret of the rows that ran (module docstring); None where
    there are too few."""
    ok = [r for r in rows if r["status"] == "ok" and r["measured_step_time_s"] is not None]
    if not ok:
        return {"num_ok": 0, "mape": None, "max_error": None, "kendall_tau": None, "regret": None,
                "top_pick": None, "best_measured": None, "memory_mape": None, "memory_max_error": None}
    errors = [abs(r["step_time_error"]) for r in ok]
    memory = [abs(r["memory_error"]) for r in ok]
    top = min(ok, key=lambda r: r["predicted_step_time_s"])
    best = min(ok, key=lambda r: r["measured_step_time_s"])
    return {
        "num_ok": len(ok), "mape": statistics.fmean(errors), "max_error": max(errors),
        "kendall_tau": kendall_tau([r["predicted_step_time_s"] for r in ok], [r["measured_step_time_s"] for r in ok]),
        "regret": top["measured_step_time_s"] / best["measured_step_time_s"] - 1.0,
        "top_pick": top["label"], "best_measured": best["label"],
        "memory_mape": statistics.fmean(memory), "memory_max_error": max(memory),
    }


def build_report(measurements: list[Measurement], settings: ValidateSettings) -> dict:
    problem = settings.problem()
    rows = [plan_row(m, problem) for m in measurements]
    return {"model": settings.model, "hardware": settings.hardware, "hardware_name": problem.cluster.hardware.name,
            "calibration": dict(problem.cluster.hardware.calibration), "nproc": settings.topology()[0],
            "cluster": settings.cluster,
            "global_batch": settings.global_batch, "seq_len": settings.seq_len, "precision": settings.precision,
            "steps": settings.steps, "rounds": settings.rounds, "timing_rounds": settings.timing_rounds,
            "num_plans": len(rows),
            "num_failed": sum(r["status"] == "failed" for r in rows), **agreement(rows), "plans": rows}


def validate(settings: ValidateSettings, *, progress: Progress | None = None, runner: Callable | None = None) -> dict:
    """Pick the plans, run them, and return the report (see the module docstring)."""
    entries = candidate_plans(settings.problem(), top_k=settings.top_k, spread=settings.spread,
                              max_plans=settings.max_plans)
    return build_report(measure(entries, settings, progress=progress, runner=runner), settings)


# --- the picture ----------------------------------------------------------------------------------
def write_scatter_png(report: dict, path: str, *, title: str | None = None) -> None:
    """Predicted against measured step time (log-log, with the y = x line and a +-10% band) and peak
    memory, one labelled point per plan that ran."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in report["plans"] if r["status"] == "ok" and r["measured_step_time_s"] is not None]
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(13, 6))
    panels = ((ax_t, "step_time_s", 1e3, "step time (ms)"), (ax_m, "peak_memory_bytes", 2.0**-20, "peak memory (MiB)"))
    for ax, key, scale, name in panels:
        xs = [r[f"measured_{key}"] * scale for r in ok]
        ys = [r[f"predicted_{key}"] * scale for r in ok]
        colors = ["tab:red" if r["source"] == "search" else "tab:blue" for r in ok]
        ax.scatter(xs, ys, c=colors, s=28, zorder=3)
        for r, x, y in zip(ok, xs, ys):
            ax.annotate(r["label"], (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
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

    tau = report.get("kendall_tau")
    ax_t.set_title(f"step time: MAPE {pct(report.get('mape'))}, max {pct(report.get('max_error'))}, "
                   f"tau {'n/a' if tau is None else f'{tau:.2f}'}, regret {pct(report.get('regret'))}", fontsize=9)
    ax_m.set_title(f"peak memory per rank: MAPE {pct(report.get('memory_mape'))}", fontsize=9)
    fig.suptitle(title or f"{report['model']} on {report['nproc']} processes, hardware {report['hardware_name']} "
                          f"(red: search's top plans)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def replace_hardware(settings: ValidateSettings, hardware: str) -> ValidateSettings:
    return dataclasses.replace(settings, hardware=hardware)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(prog=WORKER_MODULE)
    parser.add_argument("--worker", required=True)
    parser.add_argument("--out", required=True)
    cli_args = parser.parse_args()
    _worker(cli_args.worker, cli_args.out)
