"""python benchmarks/search_plausibility.py [--format table|json]

Is what the search promises believable? For each Llama 3 setting that published H100 runs measured
(benchmarks/published/: NeMo, Megatron-Bridge and Megatron-LM's Llama example, priced as Megatron-LM
runs them), the search's winner for the same model, GPU count, sequence, global batch and precision,
priced as the same engine run the way that run's recipe ran it, has a predicted MFU; the best published run of that setting has a measured
one (model FLOPs with no recomputation, cost_models.compute.model_flops_per_step, over the measured step
time, the GPU count and the bf16 peak the estimate's MFU also divides by). Target: within 10% (relative)
of each other, and the winner keeps the memory headroom (its peak at most the device memory less
--memory-headroom's default 10%).

Rows priced on the published set's own loader (planner.published), so the settings, engines and FLOP
counts are exactly those of `planner validate --published`.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cost_models.compute import model_flops_per_step  # noqa: E402
from planner.published import PUBLISHED_DIR, PublishedRun, load_published  # noqa: E402
from planner.search import SearchOptions, default_cost_model, search  # noqa: E402
from specs.model import PRESETS  # noqa: E402
from specs.problem import Problem  # noqa: E402

# The published model names of each preset (every row of these sources names one of them).
PRESET_OF = {"llama3-8b": ("LLAMA3-8B", "Llama 3 8B"), "llama3-70b": ("LLAMA3-70B", "Llama 3 70B"),
             "llama3-405b": ("Llama 3.1 405B",)}
SOURCES = ("nemo_perf_2407", "megatron_bridge_perf", "megatron_examples_llama")
TARGET = 0.10


@dataclass(frozen=True)
class Plausibility:
    setting: str
    published_plan: str
    published_mfu: float
    search_plan: str
    search_mfu: float
    search_peak_fraction: float  # the winner's peak memory over the device's
    headroom_fraction: float

    @property
    def gap(self) -> float:
        return self.search_mfu / self.published_mfu - 1

    @property
    def ok(self) -> bool:
        return abs(self.gap) <= TARGET and self.search_peak_fraction <= 1 - self.headroom_fraction


def _preset(run: PublishedRun) -> str | None:
    name = run.model.name.split(" (")[0]
    return next((p for p, names in PRESET_OF.items() if name in names), None)


def _measured_mfu(run: PublishedRun) -> float:
    flops = model_flops_per_step(run.model, global_batch=run.job.global_batch, seq_len=run.job.seq_len)
    hw = run.cluster.hardware
    return flops / (run.measured_step_time_s * run.cluster.num_devices * hw.peak_flops("bf16"))


def settings() -> dict[tuple, list[PublishedRun]]:
    """Published runs grouped by (preset, GPUs, seq, global batch, precision, engine)."""
    out: dict[tuple, list[PublishedRun]] = {}
    for name in ("dense_runs.csv", "long_context_runs.csv"):
        runs, _ = load_published(PUBLISHED_DIR / name)
        for run in runs:
            preset = _preset(run)
            if run.source_id in SOURCES and preset is not None:
                key = (preset, run.cluster.num_devices, run.job.seq_len, run.job.global_batch, run.job.precision,
                       run.engine)
                out.setdefault(key, []).append(run)
    return out


def check(key: tuple, runs: list[PublishedRun]) -> Plausibility:
    preset, gpus, seq, batch, precision, engine = key
    best = max(runs, key=_measured_mfu)
    problem = Problem(model=PRESETS[preset], cluster=best.cluster, job=best.job)
    # The search prices every plan as the best run's recipe ran its engine (its gradient dtype and fp8
    # weights: PublishedRun.priced_engine), so the winner and the published plan meet on equal terms.
    result = search(problem, options=SearchOptions(), cost=default_cost_model(best.priced_engine))
    est, hw = result.winner.estimate, best.cluster.hardware
    return Plausibility(
        setting=f"{preset} {gpus}x{best.hardware} seq {seq} batch {batch} {precision}",
        published_plan=best.plan.describe(), published_mfu=_measured_mfu(best),
        search_plan=result.winner.plan.describe(), search_mfu=est.mfu,
        search_peak_fraction=est.peak_memory_bytes / hw.memory_bytes,
        headroom_fraction=best.job.headroom(hw.device_type))


def report(rows, *, doc: str, title=lambda r: r.setting, published: str = "published best",
           search: str = "search winner ") -> int:
    """Print `rows` (each with setting, published_plan/_mfu, search_plan/_mfu, search_peak_fraction, gap,
    ok) as a table or, with --format json, JSON; the exit code is 1 when any row misses."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--format", choices=("table", "json"), default="table")
    args = parser.parse_args()
    if args.format == "json":
        print(json.dumps([{**asdict(r), "gap": r.gap, "ok": r.ok} for r in rows], indent=2))
    else:
        for r in rows:
            print(f"{title(r)}\n  {published} {r.published_plan}: MFU {r.published_mfu:.1%}\n"
                  f"  {search} {r.search_plan}: MFU {r.search_mfu:.1%} ({r.gap:+.1%}), "
                  f"peak {r.search_peak_fraction:.0%} of HBM -> {'ok' if r.ok else 'MISS'}")
    return 0 if all(r.ok for r in rows) else 1


def main() -> int:
    return report([check(key, runs) for key, runs in sorted(settings().items())], doc=__doc__)


if __name__ == "__main__":
    sys.exit(main())
