"""python benchmarks/search_speed.py [--skip-megatron] [--format table|json]

How fast `planner search` is, and how good its plans are against published ones, in one run:

1. Wall time of the `planner search` command (process start-up included) on the two target settings:
   llama3-70b on 1024 H100 (8 per node), seq 4096, global batch 1024: at most 5 s; gpt3-175b on 3072
   A100, seq 2048, global batch 1536: at most 10 s.
2. For each row of shared/reference/megatron_sc21_weak_scaling.csv (Narayanan et al., SC21, Table 1):
   the search on that row's setting against the published TP/PP with full recomputation, both priced
   by our cost model. The published plan is given its best case over micro-batch sizes (the paper does
   not list them), with 1F1B, no sequence parallelism and unsharded optimizer states as in Megatron-LM
   of 2021. The search must be at least as fast; the paper's measured TFLOP/s per GPU is shown beside
   our prediction for the published plan.
"""

from __future__ import annotations

import argparse
import csv
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

TARGETS = [
    ("llama3-70b", "h100", 1024, 1024, 4096, 5.0),
    ("gpt3-175b", "a100", 3072, 1536, 2048, 10.0),
]
REFERENCE = Path(__file__).resolve().parents[1] / "shared" / "reference" / "megatron_sc21_weak_scaling.csv"
if not REFERENCE.exists():
    REFERENCE = Path("/work/shared/reference/megatron_sc21_weak_scaling.csv")


def time_cli(model: str, hardware: str, gpus: int, batch: int, seq: int) -> dict:
    """Run `planner search` as a user would and time the whole process."""
    exe = shutil.which("planner")
    cmd = ([exe] if exe else [sys.executable, "-c", "from planner.cli import main; main()"]) + [
        "search", "--model", model, "--hardware", hardware, "--gpus", str(gpus), "--gpus-per-node", "8",
        "--global-batch", str(batch), "--seq-len", str(seq), "--format", "json"]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    wall_s = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"planner search failed: {proc.stderr.strip()}")
    out = json.loads(proc.stdout)
    best = out["plans"][0]
    return {"wall_s": wall_s, "search_time_s": out["search_time_s"], "num_evaluated": out["num_evaluated"],
            "step_time_s": best["estimate"]["step_time_s"], "mfu": best["estimate"]["mfu"], "plan": best["plan"]}


def megatron_rows() -> list[dict]:
    lines = [line for line in REFERENCE.read_text().splitlines() if line and not line.startswith("#")]
    return list(csv.DictReader(lines))


def preset_for(row: dict):
    from specs.model import PRESETS

    shape = (int(row["num_layers"]), int(row["hidden_size"]), int(row["attention_heads"]))
    for spec in PRESETS.values():
        if spec.name.startswith("gpt3-") and (spec.num_layers, spec.hidden_size, spec.num_heads) == shape:
            return spec.name
    raise SystemExit(f"no gpt3 preset with layers/hidden/heads {shape}")


def published_best(problem, *, tp: int, pp: int):
    """The published TP/PP with full recomputation, at its best micro-batch size (None if none fits)."""
    from cost_models.estimate import estimate
    from specs.plan import Plan
    from planner.search import divisors

    dp = problem.cluster.num_devices // (tp * pp)
    best = None
    for mb in divisors(problem.job.global_batch // dp):
        if mb > 16:
            break
        m = problem.job.global_batch // (dp * mb)
        plan = Plan(dp=dp, tp=tp, pp=pp, micro_batch=mb, num_micro_batches=m, schedule="1f1b", recompute="full")
        est = estimate(plan, model=problem.model, cluster=problem.cluster, job=problem.job)
        if est.fits and (best is None or est.step_time_s < best[1].step_time_s):
            best = (plan, est)
    return best


def compare_megatron() -> list[dict]:
    from specs.problem import make_problem
    from planner.search import SearchOptions, search

    out = []
    for row in megatron_rows():
        gpus, batch = int(row["num_gpus"]), int(row["global_batch"])
        tp, pp = int(row["tensor_parallel"]), int(row["pipeline_parallel"])
        problem = make_problem(model=preset_for(row), hardware="a100", gpus=gpus, gpus_per_node=8,
                               global_batch=batch, seq_len=2048)
        start = time.perf_counter()
        result = search(problem, options=SearchOptions(top_k=5))
        search_s = time.perf_counter() - start
        published = published_best(problem, tp=tp, pp=pp)
        win = result.winner
        out.append({
            "model": problem.model.name, "gpus": gpus, "global_batch": batch, "published_tp_pp": f"{tp}/{pp}",
            "published_plan": published[0].describe() if published else None,
            "published_step_time_s": published[1].step_time_s if published else None,
            "published_tflops_predicted": published[1].tflops_per_gpu if published else None,
            "published_tflops_measured": float(row["tflops_per_gpu"]),
            "search_plan": win.plan.describe(), "search_step_time_s": win.estimate.step_time_s,
            "search_tflops_predicted": win.estimate.tflops_per_gpu, "search_mfu": win.estimate.mfu,
            "search_time_s": search_s, "num_evaluated": result.num_evaluated,
            "at_least_as_fast": published is None or win.estimate.step_time_s <= published[1].step_time_s * (1 + 1e-9),
        })
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-megatron", action="store_true")
    parser.add_argument("--format", choices=("table", "json"), default="table")
    args = parser.parse_args()
    targets = []
    for model, hw, gpus, batch, seq, limit_s in TARGETS:
        res = time_cli(model, hw, gpus, batch, seq)
        targets.append({"model": model, "hardware": hw, "gpus": gpus, "global_batch": batch, "seq_len": seq,
                        "limit_s": limit_s, "ok": res["wall_s"] <= limit_s, **res})
    rows = [] if args.skip_megatron else compare_megatron()
    if args.format == "json":
        print(json.dumps({"targets": targets, "megatron": rows}, indent=2))
    else:
        _print_tables(targets, rows)
    if not all(t["ok"] for t in targets) or not all(r["at_least_as_fast"] for r in rows):
        sys.exit(1)


def _print_tables(targets: list[dict], rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=200)
    table = Table(title="planner search wall time (start-up included)")
    for col in ("setting", "wall", "limit", "ok", "search", "priced", "winner", "step", "MFU"):
        table.add_column(col)
    for t in targets:
        table.add_row(f"{t['model']} {t['gpus']}x{t['hardware']} b{t['global_batch']} s{t['seq_len']}",
                      f"{t['wall_s']:.2f} s", f"{t['limit_s']:.0f} s", "yes" if t["ok"] else "NO",
                      f"{t['search_time_s']:.2f} s", str(t["num_evaluated"]), _describe(t["plan"]),
                      f"{t['step_time_s']:.3f} s", f"{t['mfu']:.1%}")
    console.print(table)
    if not rows:
        return
    table = Table(title="Search vs the published Megatron-LM plans (SC21 Table 1), both priced by our model")
    for col in ("model", "GPUs", "batch", "published plan (best mb)", "step", "TFLOP/s pred / paper",
                "search winner", "step", "TFLOP/s pred", "speed-up", "search", "ok"):
        table.add_column(col)
    for r in rows:
        pub = r["published_step_time_s"]
        table.add_row(r["model"], str(r["gpus"]), str(r["global_batch"]), r["published_plan"] or "does not fit",
                      f"{pub:.2f} s" if pub else "-",
                      f"{r['published_tflops_predicted']:.0f} / {r['published_tflops_measured']:.0f}" if pub else "-",
                      r["search_plan"], f"{r['search_step_time_s']:.2f} s", f"{r['search_tflops_predicted']:.0f}",
                      f"{pub / r['search_step_time_s']:.2f}x" if pub else "-", f"{r['search_time_s']:.2f} s",
                      "yes" if r["at_least_as_fast"] else "NO")
    console.print(table)


def _describe(plan_dict: dict) -> str:
    from specs.plan import Plan

    return Plan.from_dict(plan_dict).describe()


if __name__ == "__main__":
    main()
