"""python benchmarks/moe.py [--steps 6] [--hardware cpu|PROFILE.json]

The tiny MoE model (8 experts top-2) on 4 CPU processes: ep4 (each rank holds 2 experts, tokens
dispatched and combined by all-to-all) against dp4 (every rank holds all 8 experts), both ZeRO-0 over
dp 4, fp32. For each plan: the measured median step time and peak memory beside the cost model's
prediction (cost_models/estimate.py on `--hardware`), and the all-to-all bytes the engine counted
(runners/comm.py) beside the formula:

    exact:    4 x (assignments sent to another EP rank) x hidden x 4 bytes      (dispatch and combine,
              + calls x world x (ep - 1)/ep x num_experts x 8 bytes              forward and backward;
                                                                                 the per-expert counts)
    uniform:  the same with (ep - 1)/ep of the tokens x k assignments leaving each rank, what the cost
              model prices (cost_models/moe.all_to_all_bytes) at the measured routing's imbalance 1

where calls = MoE layers x micro-batches per rank and the assignments sent away are the engine's own
routing counters (RunSummary.moe_rows_off_rank). The measured expert-load imbalance (busiest expert over
the mean) is the value `moe_imbalance` of a hardware profile's calibration takes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from specs.job import Job  # noqa: E402
from specs.model import PRESETS  # noqa: E402
from specs.plan import Plan  # noqa: E402

MODEL = PRESETS["tiny-moe"]
WORLD, SEQ_LEN, GLOBAL_BATCH = 4, 64, 8
PLANS = {"ep4": Plan(dp=4, ep=4, micro_batch=2, num_micro_batches=1),
         "dp4": Plan(dp=4, micro_batch=2, num_micro_batches=1)}


def run_config(plan: Plan, *, steps: int):
    from runners.config import RunConfig

    return RunConfig(plan=plan, model=MODEL, job=Job(global_batch=GLOBAL_BATCH, seq_len=SEQ_LEN, precision="fp32"),
                     steps=steps, seed=0, lr=1e-3, timeout_s=600)


def formula_bytes(plan: Plan, *, rows_off_rank: float) -> tuple[float, float]:
    """(exact, uniform) all-to-all bytes of one step over all ranks (module docstring)."""
    from cost_models.moe import all_to_all_bytes

    if plan.ep == 1:
        return 0.0, 0.0
    calls = MODEL.num_moe_layers * plan.num_micro_batches
    counts = calls * WORLD * (plan.ep - 1) / plan.ep * MODEL.num_experts * 8
    exact = 4 * rows_off_rank * MODEL.hidden_size * 4 + counts
    tokens = plan.micro_batch * SEQ_LEN
    uniform = 4 * calls * WORLD * all_to_all_bytes(MODEL, tokens=tokens, ep=plan.ep, ranks_per_node=WORLD,
                                                   precision="fp32").total + counts
    return exact, uniform


def predicted(plan: Plan, hardware: str):
    from cost_models.estimate import estimate
    from specs.cluster import Cluster
    from specs.hardware import resolve_hardware

    cluster = Cluster(num_nodes=1, devices_per_node=WORLD, hardware=resolve_hardware(hardware))
    return estimate(plan, model=MODEL, cluster=cluster, job=Job(global_batch=GLOBAL_BATCH, seq_len=SEQ_LEN, precision="fp32"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--hardware", default="cpu", help="hardware preset or profile JSON for the prediction")
    args = parser.parse_args(argv)
    from runners.launch import Where, run_workers

    cfgs = [run_config(plan, steps=args.steps).to_dict() for plan in PLANS.values()]
    runs = run_workers("runners.train", {"runs": cfgs}, where=Where(nproc=WORLD))["runs"]
    print(f"tiny-moe on {WORLD} CPU processes, batch {GLOBAL_BATCH} x {SEQ_LEN}, {args.steps} steps "
          f"(median of the last {args.steps - 1}); prediction on {args.hardware}")
    print(f"{'plan':6} {'step ms':>8} {'pred ms':>8} {'peak MiB':>9} {'pred MiB':>9} {'a2a bytes':>10} "
          f"{'exact':>10} {'uniform':>10} {'off-rank':>9} {'imbalance':>9}")
    for (name, plan), run in zip(PLANS.items(), runs):
        summary = run["summary"]
        est = predicted(plan, args.hardware)
        exact, uniform = formula_bytes(plan, rows_off_rank=summary["moe_rows_off_rank"])
        measured = summary["comm_bytes"]["all_to_all"]
        print(f"{name:6} {summary['median_step_time_s'] * 1e3:8.2f} {est.step_time_s * 1e3:8.2f} "
              f"{summary['peak_memory_bytes'] / 2**20:9.1f} {est.peak_memory_bytes / 2**20:9.1f} {measured:10d} "
              f"{exact:10.0f} {uniform:10.0f} {summary['moe_rows_off_rank']:9.1f} {summary['moe_imbalance']:9.3f}")
        if abs(measured - exact) > 0.5 * WORLD:  # per-rank integer rounding of the counted volumes
            print(f"{name}: all-to-all bytes {measured} differ from the formula's {exact:.0f}")
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
