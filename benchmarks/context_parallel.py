"""python benchmarks/context_parallel.py [--quick] [--repeats 3] [--steps 3] [--budget-mib 480] [--profile P.json]

Context parallelism against full recomputation on 4 local gloo CPU processes, at the longest sequence
that fits: cp4 (ring, and all-to-all) against dp4 with full recomputation, the same model, the same
global batch in tokens (4 sequences: dp4 runs one per rank, cp4 a quarter of each of the 4 as 4
micro-batches), beside the cost model's prediction priced with this machine's measured profile (the cached
one for 4 processes, measured with this model: `load_hardware`; or --profile).

"Fits" (`longest_fitting`, `confirm_fit`): the sequence is the longest of the doubling ladder LADDER (--quick:
QUICK_LADDER) at which dp4 with full recomputation keeps its peak memory per rank within the budget
(--budget-mib, of the peak memory per rank as `planner run` reports it): the longest the cost
model predicts to fit, confirmed by a run of it; where the run measures more than the budget, the next
shorter one is tried.

Measured, each in fresh processes for memory: peak memory per rank (runners/activation.py probe;
the largest rank, from step 1 on) and the activation bytes one micro-batch's forward keeps for backward
(saved-tensor hooks, each storage once, parameters left out) for cp1 (dp4), cp2 (dp2 x cp2) and cp4 without
recomputation, which should fall as 1/cp. Step times: one set of processes holds every timed plan's
trainer and the plans take turns (runners/timing.py, the step loop's own timed_step), --steps steps per
plan per round, --repeats rounds; the ratio cp4 / dp4 is the median over rounds of the within-round ratio
of median step times ("paired"; the two run minutes apart at most, so load drift cancels), beside the
same ratio of the steps' CPU seconds summed over the ranks (the work; waits for peers that another job's
load descheduled do not count).
Prints a table and one JSON line (`--json-out` also writes it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path
from typing import Callable, Sequence

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from specs.job import Job  # noqa: E402
from specs.model import PRESETS  # noqa: E402
from specs.plan import Plan  # noqa: E402

WORLD = 4
GLOBAL_BATCH = 4  # sequences per step
# Capped at 4096: a dp4 step there takes ~5 s on a shared 2-core host, and the fit rule may probe it.
LADDER = (512, 1024, 2048, 4096)
QUICK_LADDER = (256, 512, 1024)
# 480 MiB of resident set before peak memory left out the mapped library files (~80 MiB a rank here).
BUDGET_MIB = 400
MIB = 2**20
# Four heads of 32 (no GQA, so all-to-all can split them over 4 ranks), 4 layers: attention's share of a
# step grows with the sequence while a 2-core host still runs a step in a second or two.
MODEL = dataclasses.replace(PRESETS["tiny"], name="tiny-h128-l4", hidden_size=128, num_heads=4, num_kv_heads=4,
                            ffn_hidden_size=352, num_layers=4, max_seq_len=max(LADDER))

TIMED = {  # label -> plan; the first is the baseline of every ratio
    "dp4 full recompute": Plan(dp=4, recompute="full"),
    "cp4 ring": Plan(cp=4, num_micro_batches=4),
    "cp4 all-to-all": Plan(cp=4, cp_kind="all-to-all", num_micro_batches=4),
}
ACTIVATION = {  # cp -> plan, no recomputation, one sequence per micro-batch
    1: Plan(dp=4),
    2: Plan(dp=2, cp=2, num_micro_batches=2),
    4: Plan(cp=4, num_micro_batches=4),
}
BASELINE = "dp4 full recompute"


# --- the fit rule (pure) --------------------------------------------------------------------------------
def doubling_ladder(first: int, last: int) -> tuple[int, ...]:
    """first, 2 first, ... up to last (inclusive)."""
    if not 0 < first <= last:
        raise ValueError(f"need 0 < first <= last, got {first} and {last}")
    out = [first]
    while out[-1] * 2 <= last:
        out.append(out[-1] * 2)
    return tuple(out)


def longest_fitting(ladder: Sequence[int], peak_bytes: Callable[[int], float], budget_bytes: float) -> int | None:
    """The longest sequence of `ladder` whose `peak_bytes(seq)` is within the budget, or None."""
    fitting = [s for s in ladder if peak_bytes(s) <= budget_bytes]
    return max(fitting) if fitting else None


def confirm_fit(ladder: Sequence[int], *, predicted_bytes: Callable[[int], float],
                measured_bytes: Callable[[int], float], budget_bytes: float) -> tuple[int | None, list[tuple[int, float, float]]]:
    """The longest sequence the prediction fits and a run confirms: start at longest_fitting, measure, and
    step down the ladder while the measurement exceeds the budget. Returns (sequence or None, every
    (seq, predicted, measured) tried, longest first)."""
    seq = longest_fitting(ladder, predicted_bytes, budget_bytes)
    tried = []
    candidates = sorted((s for s in ladder if seq is not None and s <= seq), reverse=True)
    for s in candidates:
        measured = measured_bytes(s)
        tried.append((s, predicted_bytes(s), measured))
        if measured <= budget_bytes:
            return s, tried
    return None, tried


# --- configs and predictions ------------------------------------------------------------------------------
def job(seq_len: int) -> Job:
    return Job(global_batch=GLOBAL_BATCH, seq_len=seq_len, precision="fp32")


def estimate_of(plan: Plan, *, seq_len: int, hardware):
    from cost_models.estimate import estimate
    from specs.cluster import make_cluster

    cluster = make_cluster(hardware=hardware, num_devices=WORLD, devices_per_node=WORLD)
    return estimate(plan, model=MODEL, cluster=cluster, job=job(seq_len))


def run_config(plan: Plan, *, seq_len: int, steps: int):
    from runners.config import RunConfig

    return RunConfig(plan=plan, model=MODEL, job=job(seq_len), steps=steps, seed=0, timeout_s=1800)


# --- measuring (runners.launch, the one launcher) ---------------------------------------------------------
def probe(plans: list[Plan], *, seq_len: int, steps: int) -> list[dict]:
    """The memory probe (runners/activation.py) of `plans` in one launch: list of MemoryProbe dicts."""
    from runners.launch import Where, run_workers

    spec = {"runs": [run_config(p, seq_len=seq_len, steps=steps).to_dict() for p in plans]}
    return run_workers("runners.activation", spec, where=Where(nproc=WORLD))["runs"]


def time_plans(*, seq_len: int, rounds: int, steps: int) -> tuple[dict[str, list[list[float]]], dict[str, list[list[float]]]]:
    """(wall, cpu): label -> per round, that round's step times, and their CPU seconds summed over the
    ranks (every plan's trainer in one set of processes)."""
    from runners.config import TimingResult, TimingSpec
    from runners.launch import Where, run_workers

    spec = TimingSpec(configs=tuple(run_config(p, seq_len=seq_len, steps=1) for p in TIMED.values()),
                      labels=tuple(TIMED), rounds=rounds, steps_per_round=steps)
    result = TimingResult.from_dict(run_workers("runners.timing", spec.to_dict(), where=Where(nproc=WORLD)))
    def per_round(series):
        return {label: [list(t[r * steps:(r + 1) * steps]) for r in range(rounds)] for label, t in zip(TIMED, series)}

    return per_round(result.step_times_s), per_round(result.cpu_times_s)


def paired_ratio(a: list[list[float]], b: list[list[float]]) -> float:
    """Median over rounds of median(a) / median(b) within the round."""
    return statistics.median(statistics.median(x) / statistics.median(y) for x, y in zip(a, b))


# --- the benchmark --------------------------------------------------------------------------------------
def load_hardware(profile: str | None):
    """(Hardware, where it came from): --profile, or this machine's profile for WORLD processes measured
    with MODEL itself (planner/machine.local_profile with MODEL's JSON, cached in its own folder of the cache
    and re-measured when stale): its layer probe runs MODEL's own Block, and its attention sweep MODEL's head
    width, so neither is extrapolated from the tiny model's (head width 8, a 64-wide layer whose GEMMs run
    1.6x further from the GEMM sweep's prediction)."""
    from planner.machine import cache_dir, local_profile
    from specs.hardware import resolve_hardware

    if profile:
        return resolve_hardware(profile), profile
    directory = cache_dir() / MODEL.name
    directory.mkdir(parents=True, exist_ok=True)
    model_json = directory / "model.json"
    model_json.write_text(json.dumps(MODEL.to_dict(), indent=1))
    path, _ = local_profile(WORLD, model=str(model_json), directory=str(directory))
    return resolve_hardware(path), path


def choose_seq(ladder: Sequence[int], *, hardware, budget_bytes: float, steps: int):
    """(sequence, tried rows, the baseline's probe at it): the fit rule applied to dp4 with full recompute."""
    probes: dict[int, dict] = {}

    def measured(seq: int) -> float:
        probes[seq] = probe([TIMED[BASELINE]], seq_len=seq, steps=steps)[0]
        return probes[seq]["peak_resident_bytes"]

    seq, tried = confirm_fit(ladder, budget_bytes=budget_bytes, measured_bytes=measured,
                             predicted_bytes=lambda s: estimate_of(TIMED[BASELINE], seq_len=s, hardware=hardware).peak_memory_bytes)
    if seq is None:
        raise SystemExit(f"dp4 with full recomputation fits {budget_bytes / MIB:.0f} MiB per rank at no sequence of "
                         f"{list(ladder)} (tried: {tried}); raise --budget-mib")
    return seq, tried, probes[seq]


def measure_all(args, hardware) -> dict:
    ladder = QUICK_LADDER if args.quick else LADDER
    budget = args.budget_mib * MIB
    seq, tried, baseline_probe = choose_seq(ladder, hardware=hardware, budget_bytes=budget, steps=2)
    memory = {BASELINE: baseline_probe}
    for label, plan in TIMED.items():
        if label != BASELINE:
            memory[label] = probe([plan], seq_len=seq, steps=2)[0]
    activations = dict(zip(ACTIVATION, probe(list(ACTIVATION.values()), seq_len=seq, steps=1)))
    times, cpu = time_plans(seq_len=seq, rounds=args.repeats, steps=args.steps)
    return {"seq": seq, "tried": tried, "budget": budget, "memory": memory, "activations": activations, "times": times,
            "cpu": cpu}


def summarise(measured: dict, hardware, *, source: str) -> dict:
    """The typed-enough JSON of one run: every figure the table prints."""
    seq, times, cpu = measured["seq"], measured["times"], measured["cpu"]
    est = {label: estimate_of(plan, seq_len=seq, hardware=hardware) for label, plan in TIMED.items()}
    plans = {}
    for label in TIMED:
        ratio = paired_ratio(times[label], times[BASELINE])
        predicted_ratio = est[label].step_time_s / est[BASELINE].step_time_s
        probe_row = measured["memory"][label]
        plans[label] = {
            "step_time_s": statistics.median(t for r in times[label] for t in r),
            "predicted_step_time_s": est[label].step_time_s, "ratio": ratio, "predicted_ratio": predicted_ratio,
            "ratio_error": predicted_ratio / ratio - 1,
            # CPU seconds of all ranks: the work, which other jobs' load and waits for descheduled peers
            # barely move; with 4 ranks on 2 cores a quiet host's step is about this work over the cores.
            "cpu_s": statistics.median(t for r in cpu[label] for t in r), "cpu_ratio": paired_ratio(cpu[label], cpu[BASELINE]),
            "peak_memory_bytes": probe_row["peak_resident_bytes"], "predicted_peak_memory_bytes": est[label].peak_memory_bytes,
            "idle_memory_bytes": probe_row["idle_resident_bytes"],
            # Blocked on communication per step (the memory run's steps) against the exposed communication
            # the cost model prices: where a ratio misses, whether the messages or the compute are off.
            "comm_wait_s": probe_row.get("comm_wait_s", 0.0), "predicted_exposed_comm_s": est[label].breakdown["exposed_comm_s"]}
    act = {}
    for cp, plan in ACTIVATION.items():
        predicted = estimate_of(plan, seq_len=seq, hardware=hardware).breakdown["activations_bytes"]
        act[cp] = {"plan": plan.describe(), "saved_bytes": measured["activations"][cp]["saved_activation_bytes"],
                   "predicted_bytes": predicted}
    for cp, row in act.items():
        row["cp1_over_this"] = act[1]["saved_bytes"] / row["saved_bytes"]
    return {"benchmark": "context_parallel", "model": MODEL.name, "world": WORLD, "global_batch": GLOBAL_BATCH,
            "seq_len": seq, "budget_bytes": measured["budget"], "hardware": source,
            "fit_tried": [{"seq_len": s, "predicted_bytes": p, "measured_bytes": m} for s, p, m in measured["tried"]],
            "dp4_no_recompute_predicted_peak_bytes": estimate_of(ACTIVATION[1], seq_len=seq, hardware=hardware).peak_memory_bytes,
            "rounds": len(times[BASELINE]), "steps_per_round": len(times[BASELINE][0]), "plans": plans, "activation": act}


def print_table(summary: dict) -> None:
    s = summary
    print(f"{s['model']}, {s['world']} gloo CPU processes, global batch {s['global_batch']} x {s['seq_len']} tokens; "
          f"budget {s['budget_bytes'] / MIB:.0f} MiB per rank (peak memory); profile {s['hardware']}")
    for row in s["fit_tried"]:
        print(f"  fit: dp4 full recompute at seq {row['seq_len']}: predicted {row['predicted_bytes'] / MIB:.1f} MiB, "
              f"measured {row['measured_bytes'] / MIB:.1f} MiB")
    print(f"  dp4 without recomputation at seq {s['seq_len']}: predicted {s['dp4_no_recompute_predicted_peak_bytes'] / MIB:.1f} MiB")
    print(f"\n{'plan':<20} {'step s':>8} {'pred s':>8} {'ratio':>7} {'pred':>7} {'error':>7} {'cpu-s':>7} {'cpu ratio':>9}  {'peak MiB':>9} "
          f"{'pred MiB':>9} {'idle MiB':>9}  {'comm wait s':>11} {'pred comm s':>11}")
    for label, p in s["plans"].items():
        print(f"{label:<20} {p['step_time_s']:>8.3f} {p['predicted_step_time_s']:>8.3f} {p['ratio']:>7.3f} "
              f"{p['predicted_ratio']:>7.3f} {p['ratio_error']:>+7.1%} {p['cpu_s']:>7.2f} {p['cpu_ratio']:>9.3f}  "
              f"{p['peak_memory_bytes'] / MIB:>9.1f} "
              f"{p['predicted_peak_memory_bytes'] / MIB:>9.1f} {p['idle_memory_bytes'] / MIB:>9.1f}  "
              f"{p['comm_wait_s']:>11.3f} {p['predicted_exposed_comm_s']:>11.3f}")
    print(f"ratio: paired median over {s['rounds']} rounds x {s['steps_per_round']} steps, against {BASELINE}; "
          f"error = predicted ratio / measured ratio - 1 (target within 10%); cpu-s: CPU seconds per step, all ranks; comm wait: blocked on communication per "
          f"step in the memory run, beside the predicted exposed communication")
    print(f"\n{'activations (no recompute)':<34} {'saved MiB':>10} {'pred MiB':>9} {'cp1 / this':>10}")
    for cp, a in s["activation"].items():
        print(f"cp{cp}: {a['plan']:<29} {a['saved_bytes'] / MIB:>10.2f} {a['predicted_bytes'] / MIB:>9.2f} "
              f"{a['cp1_over_this']:>10.3f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"ladder {QUICK_LADDER}, 2 rounds x 2 steps")
    parser.add_argument("--repeats", type=int, default=None, help="timing rounds (default 3; --quick 2)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per plan per round (default 3; --quick 2)")
    parser.add_argument("--budget-mib", type=float, default=BUDGET_MIB, help="peak memory per rank")
    parser.add_argument("--profile", help="hardware profile JSON (default: this machine's for 4 processes, measured with the benchmark's model)")
    parser.add_argument("--json-out", help="also write the JSON line here")
    args = parser.parse_args()
    args.repeats = args.repeats or (2 if args.quick else 3)
    args.steps = args.steps or (2 if args.quick else 3)
    hardware, source = load_hardware(args.profile)
    summary = summarise(measure_all(args, hardware), hardware, source=source)
    print_table(summary)
    line = json.dumps(summary)
    print(line)
    if args.json_out:
        Path(args.json_out).write_text(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
