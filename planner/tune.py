"""`planner tune`: the main job in one command: profile this node (or reuse its cached profile), search
with that profile as the hardware, train the winner on our engine for a few steps, and report measured
against predicted.

    planner tune                                   # tiny model on 2 local CPU processes
    planner tune --nproc 4 --global-batch 16 --steps 10 --format json
    planner tune --refresh-profile                 # measure again instead of reusing the cache

The profile is cached in ~/.cache/planner/ (or $PLANNER_CACHE_DIR) under the host name and process
count, since both change what one process can do; `planner calibrate` results written into that file
are used by the next tune's search.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from planner.errors import PlannerError

Progress = Callable[[str, int, "int | None", str], None]


def _no_progress(stage: str, done: int, total: int | None, label: str) -> None:
    pass


@dataclass(frozen=True)
class TuneSettings:
    model: str = "tiny"
    nproc: int = 2
    global_batch: int = 8
    seq_len: int = 64
    precision: str | None = None
    steps: int = 8
    profile: str | None = None  # a profile JSON to use as is; None: the cache (measured when missing)
    refresh_profile: bool = False
    cache_dir: str | None = None
    seed: int = 0
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if self.nproc < 2:
            raise PlannerError(f"--nproc must be at least 2 (the profile measures collectives), got {self.nproc}")
        if self.steps < 2:
            raise PlannerError(f"--steps must be at least 2 (the first step is a warm-up), got {self.steps}")
        if self.profile is not None and self.refresh_profile:
            raise PlannerError("give either --profile or --refresh-profile, not both")


def cache_dir(settings: TuneSettings) -> Path:
    return Path(settings.cache_dir or os.environ.get("PLANNER_CACHE_DIR") or Path.home() / ".cache" / "planner")


def cached_profile_path(settings: TuneSettings) -> Path:
    """The cache entry for this host and process count."""
    host = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in socket.gethostname()) or "host"
    return cache_dir(settings) / f"profile-{host}-n{settings.nproc}.json"


def ensure_profile(settings: TuneSettings, *, progress: Progress = _no_progress) -> tuple[str, bool]:
    """(profile path, whether it was reused): the given one, the cached one, or a fresh quick profile."""
    from profilers.hardware import resolve_hardware

    if settings.profile is not None:
        resolve_hardware(settings.profile)  # refuse a bad file before anything runs
        return settings.profile, True
    path = cached_profile_path(settings)
    if path.exists() and not settings.refresh_profile:
        try:
            resolve_hardware(str(path))
            return str(path), True
        except PlannerError:
            pass  # a stale or broken cache entry is measured again
    from profilers.profile import ProfileOptions, run_profile

    hardware = run_profile(ProfileOptions(nproc=settings.nproc, quick=True, model=settings.model), progress=progress)
    hardware.save(path)
    return str(path), False


def tune(settings: TuneSettings = TuneSettings(), *, progress: Progress = _no_progress,
         on_step: Callable[[dict], None] | None = None) -> dict:
    """Profile, search, run the winner, and return the report (see `report_lines`)."""
    from planner.inputs import make_problem
    from planner.search import SearchOptions, search
    from runners.launch import launch
    from runners.train import RunConfig

    start = time.perf_counter()
    profile, reused = ensure_profile(settings, progress=progress)
    profiled = time.perf_counter()
    progress("search", 0, None, "searching")
    problem = make_problem(model=settings.model, hardware=profile, gpus=settings.nproc, gpus_per_node=settings.nproc,
                           global_batch=settings.global_batch, seq_len=settings.seq_len, precision=settings.precision)
    result = search(problem, options=SearchOptions(top_k=3))
    winner = result.winner
    searched = time.perf_counter()
    progress("train", 0, settings.steps, winner.plan.describe())
    cfg = RunConfig(plan=winner.plan, model=problem.model, job=problem.job, steps=settings.steps, seed=settings.seed,
                    ranks_per_node=settings.nproc, hardware=profile, timeout_s=settings.timeout_s)
    metrics = launch(cfg, nproc=settings.nproc, on_step=on_step)
    if metrics is None:
        raise PlannerError("the run wrote no metrics")
    done = time.perf_counter()
    predicted, summary = winner.estimate, metrics["summary"]
    return {
        "profile": profile, "profile_reused": reused, "calibrated": bool(problem.cluster.hardware.calibration),
        "plan": winner.plan.to_dict(), "describe": winner.plan.describe(),
        "runner_up": [c.plan.describe() for c in result.candidates[1:3]],
        "predicted": predicted.to_dict(), "measured": summary, "losses": [s["loss"] for s in metrics["steps"]],
        "step_time_ratio": summary["median_step_time_s"] / predicted.step_time_s,
        "memory_ratio": summary["peak_memory_bytes"] / predicted.peak_memory_bytes,
        "profile_time_s": profiled - start, "search_time_s": searched - profiled, "run_time_s": done - searched,
        "total_time_s": done - start,
    }


def report_lines(report: dict) -> list[str]:
    """The terminal summary of a tune report."""
    p, m = report["predicted"], report["measured"]
    lines = [
        f"profile: {report['profile']} ({'reused' if report['profile_reused'] else 'measured now'}"
        f"{', calibrated' if report['calibrated'] else ', not calibrated'}) in {report['profile_time_s']:.1f} s",
        f"best plan: {report['describe']} (searched in {report['search_time_s']:.1f} s)",
        f"trained {len(report['losses'])} steps in {report['run_time_s']:.1f} s: loss {report['losses'][0]:.4f} -> "
        f"{report['losses'][-1]:.4f}",
        f"step time: measured {m['median_step_time_s'] * 1e3:.1f} ms, predicted {p['step_time_s'] * 1e3:.1f} ms "
        f"(measured / predicted {report['step_time_ratio']:.2f})",
        f"peak memory per rank: measured {m['peak_memory_bytes'] / 2**20:.1f} MiB, predicted "
        f"{p['peak_memory_bytes'] / 2**20:.1f} MiB (measured / predicted {report['memory_ratio']:.2f})",
        f"total {report['total_time_s']:.1f} s",
    ]
    if not report["calibrated"] and abs(report["step_time_ratio"] - 1) > 0.2:
        lines.append("the uncalibrated profile misses CPU-side overheads; fit them with `planner validate --hardware "
                     f"{report['profile']} --out v.json` then `planner calibrate --measurements v.json`")
    return lines
