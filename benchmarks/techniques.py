"""sudo python benchmarks/techniques.py [--bandwidth 1gbit] [--repeats 3] [--steps 3] [--profile P.json] [--pairs ...]

Lins, MAZ3 and Commshift measured side by side against their baselines, with the cost model's prediction:

- MAZ3 device tier vs ZeRO-3 (targets: all-gather bytes <= 0.70x, step time <= 0.9x on the shaped link);
- Lins (s_p, s_g, s_os) = (2, 2, 4), parameters and gradients sharded inside the node and optimizer states
  over all of DP, vs ZeRO-3 (fewer inter-node bytes; step time <= 0.8x);
- Commshift vs the same pp2 x dp2 plan without it, on two layouts (SHAPES): 4 x 1, where the last
  input-gradient send and the DP reduction leave through one shaped NIC (step time <= 0.95x), and 2 x 2,
  where the reduction stays inside the node (no change: within 2 points of 1). Its workload has large
  activations (`CS_MODEL`) and wants a slow NIC: `--pairs commshift --bandwidth 20mbit`;
- the cost model, priced with a profile measured on the same emulated cluster, predicts each measured
  step-time ratio within 10%, Commshift's within 2 points (the verdict judges one declared prediction,
  `--prediction`: the profile as measured by default, or calibrated on the baseline's measured step).

Two runs of the same plans:
1. byte counters on 4 local gloo processes grouped into nodes as on the plan's cluster (`ranks_per_node`:
   the ring edges that join ranks of different groups count as inter-node), one short run per plan;
2. step times on the emulated clusters (runners/netns_cluster.py: network-namespace nodes, each node's NIC
   shaped to --bandwidth; needs root): 2 nodes of 2 processes for MAZ3 and Lins, 4 nodes of 1 and 2 of 2
   for Commshift (see SHAPES). One set of processes runs every plan `--repeats`
   times, plans interleaved and each pair's order alternated so that load drift hits both sides alike;
   each run's first step is dropped, and a ratio is the median over repeats of the within-repeat ratio of
   median step times ("paired"), next to the ratio of overall medians.
The prediction prices each plan with `--profile` (a `planner profile --cluster` JSON of the 2 x 2 cluster,
whose inter-node fit is the same NIC for 4 x 1), or with a quick profile measured on it first. The cluster is removed at the end, also on failure.

MAZ3's and Lins' model is the tiny llama made wider and deeper so that parameter traffic matters on the
shaped link while a step stays a few seconds on a shared 2-core host (fp32: CPUs have no fast bf16).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from specs.job import Job  # noqa: E402
from specs.model import PRESETS  # noqa: E402
from specs.plan import Plan  # noqa: E402

PREFIX = "pltech"
WORLD = 4
# Emulated cluster shapes (nodes, processes per node); the Megatron rank order (tp, cp, dp, pp
# innermost-first) puts pp2 x dp2's stage s, DP replica d on rank d + 2 s. Lins and MAZ3 run on 2 nodes
# of 2, where their groups have an intra-node part. Commshift runs on both: on 4 x 1 each rank is a
# node, so a stage's last input-gradient send (rank 2 -> 0, 3 -> 1) and its DP reduction (2 <-> 3)
# leave through the same shaped NIC; on 2 x 2 the send crosses the shaped link (node 1 -> node 0) while
# the reduction stays inside the node, on loopback: nothing to share.
SHAPES = {"2x2": (2, 2), "4x1": (4, 1)}
SEQ_LEN = 64
MODEL = dataclasses.replace(PRESETS["tiny"], name="tiny-h256-l8", hidden_size=256, num_heads=8, num_kv_heads=4,
                            ffn_hidden_size=704, num_layers=8, max_seq_len=SEQ_LEN)
# Commshift's gain is at most one send's transfer time per step (cost_models/linkshare.py), so its
# workload has large activations against the per-micro-batch compute and a stage reduction a little
# larger than one send (which it then slows by the full 2x): a long sequence (1 x 1024 x 128 fp32
# activations, 512 KiB), one layer per stage (~0.9 MB of gradients with the head), two micro-batches,
# run with a slow NIC (README: --bandwidth 20mbit).
CS_SEQ_LEN = 1024
CS_MODEL = dataclasses.replace(PRESETS["tiny"], name="tiny-h128-l2-s1024", hidden_size=128, num_heads=8,
                               num_kv_heads=4, ffn_hidden_size=352, num_layers=2, max_seq_len=CS_SEQ_LEN)
WORKLOADS = {"wide": (MODEL, SEQ_LEN), "long": (CS_MODEL, CS_SEQ_LEN)}
M = 4  # micro-batches per step
CS_PLAN = Plan(dp=2, pp=2, num_micro_batches=2, schedule="1f1b")

PLANS = {  # name: (cluster shape, plan, workload)
    "zero3": ("2x2", Plan(dp=4, param_shard=4, grad_shard=4, optim_shard=4, num_micro_batches=M), "wide"),
    "maz3-device": ("2x2", Plan(dp=4, param_shard=4, grad_shard=4, optim_shard=4, num_micro_batches=M,
                                param_cache="device"), "wide"),
    "lins-2-2-4": ("2x2", Plan(dp=4, param_shard=2, grad_shard=2, optim_shard=4, num_micro_batches=M), "wide"),
    "pp2-dp2-4x1": ("4x1", CS_PLAN, "long"),
    "pp2-dp2-4x1-commshift": ("4x1", CS_PLAN.replace(commshift=True), "long"),
    "pp2-dp2-2x2": ("2x2", CS_PLAN, "long"),
    "pp2-dp2-2x2-commshift": ("2x2", CS_PLAN.replace(commshift=True), "long"),
}
# (name, technique plan, baseline plan, step-time target, (counter, byte-ratio target) or None); a
# target of None: the technique should change nothing (measured ratio within 2 points of 1).
PAIRS = [
    ("MAZ3 device vs ZeRO-3", "maz3-device", "zero3", 0.90, ("all_gather", 0.70)),
    ("Lins (2,2,4) vs ZeRO-3", "lins-2-2-4", "zero3", 0.80, ("inter_node", 0.999)),
    ("Commshift, shared NIC", "pp2-dp2-4x1-commshift", "pp2-dp2-4x1", 0.95, None),
    ("Commshift, apart", "pp2-dp2-2x2-commshift", "pp2-dp2-2x2", None, None),
]


def selected_pairs(which: str) -> list[int]:
    """Indices of the PAIRS whose title contains one of the comma-separated words (case-insensitive)."""
    words = [w.strip().lower() for w in which.split(",") if w.strip()]
    return [i for i, pair in enumerate(PAIRS) if any(w in pair[0].lower() for w in words)]


def run_config(name: str, *, steps: int):
    from runners.config import RunConfig

    shape, plan, workload = PLANS[name]
    model, seq_len = WORKLOADS[workload]
    job = Job(global_batch=plan.global_batch, seq_len=seq_len, precision="fp32")
    return RunConfig(plan=plan, model=model, job=job, steps=steps, seed=0, ranks_per_node=SHAPES[shape][1],
                     timeout_s=1800)


def interleaved_jobs(shape: str, *, repeats: int, steps: int, pairs: list[int]) -> list[tuple[str, dict]]:
    """(label, run config dict) in run order for the selected pairs on `shape`: each pair's two plans
    adjacent, their order alternating over repeats."""
    jobs = []
    for r in range(repeats):
        for i, (_, a, b, _, _) in enumerate(PAIRS):
            if PLANS[a][0] != shape or i not in pairs:
                continue
            for name in ((a, b) if (r + i) % 2 == 0 else (b, a)):
                jobs.append((f"{name}|{i}|{r}", run_config(name, steps=steps).to_dict()))
    return jobs


# --- running: one set of processes trains every job in turn (runners.train's series task) --------------
def run_jobs(jobs: list[tuple[str, dict]], *, cluster: str | None = None) -> list[dict]:
    """The jobs on WORLD local processes (grouped into nodes by each config's ranks_per_node), or across
    the emulated cluster `cluster`; each result is {"label", "steps", "summary"}."""
    from runners.launch import Where, run_workers

    where = Where(nproc=WORLD) if cluster is None else Where(cluster=cluster)
    runs = run_workers("runners.train", {"runs": [cfg for _, cfg in jobs]}, where=where)["runs"]
    return [{"label": label, "steps": run["steps"], "summary": run["summary"]} for (label, _), run in zip(jobs, runs)]


# --- analysis ------------------------------------------------------------------------------------------
def step_times_by_plan(results: list[dict]) -> dict[tuple[str, int], list[list[float]]]:
    """(plan, pair index) -> per repeat, that run's step times after the first (a baseline shared by two
    pairs runs once for each, next to its partner)."""
    out: dict[tuple[str, int], list[list[float]]] = {}
    for r in results:
        name, pair, _ = r["label"].split("|")
        out.setdefault((name, int(pair)), []).append([s["step_time_s"] for s in r["steps"][1:]])
    return out


def ratios(times: dict, a: tuple[str, int], b: tuple[str, int]) -> tuple[float, float, float, float]:
    """(median step a, median step b, ratio of the medians, paired ratio: median over repeats of a / b)."""
    ma, mb = (statistics.median(t for run in times[x] for t in run) for x in (a, b))
    paired = statistics.median(statistics.median(x) / statistics.median(y) for x, y in zip(times[a], times[b]))
    return ma, mb, ma / mb, paired


def predicted_step_s(hardware, name: str) -> float:
    from cost_models.estimate import estimate
    from specs.cluster import Cluster

    cfg = run_config(name, steps=1)
    num_nodes, per_node = SHAPES[PLANS[name][0]]
    cluster = Cluster(num_nodes=num_nodes, devices_per_node=per_node, hardware=hardware)
    return estimate(cfg.plan, model=cfg.model, cluster=cluster, job=cfg.job).step_time_s


def calibrated_on(hardware, name: str, measured_s: float):
    """`hardware` with op_overhead_s (the CPU-side seconds per launched op that a fresh profile leaves at
    0; see cost_models/estimate.py) set so that plan `name` is predicted at its measured step time:
    calibrated on the baseline alone, the technique's prediction uses no measurement of the technique.
    The step time grows monotonically with the overhead, so bisection finds it."""
    from specs.hardware import with_calibration

    low, high = 0.0, 1.0
    for _ in range(60):
        mid = (low + high) / 2
        if predicted_step_s(with_calibration(hardware, {"op_overhead_s": mid}), name) < measured_s:
            low = mid
        else:
            high = mid
    return with_calibration(hardware, {"op_overhead_s": low})


def print_bytes(results: list[dict]) -> None:
    counters = {r["label"].split("|")[0]: r["summary"]["comm_bytes"] for r in results}
    print(f"Byte counters per step (all ranks), {WORLD} local processes grouped into nodes as on their cluster:")
    print(f"{'plan':<20} {'nodes':>5} {'all_gather':>11} {'reduce_sc':>11} {'all_reduce':>11} {'p2p':>10} "
          f"{'host_dev':>10} {'intra':>11} {'inter':>11}")
    for name, c in counters.items():
        print(f"{name:<20} {PLANS[name][0]:>5} {c.get('all_gather', 0):>11} {c.get('reduce_scatter', 0):>11} "
              f"{c.get('all_reduce', 0):>11} {c.get('p2p', 0):>10} {c.get('host_device', 0):>10} "
              f"{c.get('intra_node', 0):>11} {c.get('inter_node', 0):>11}")
    for title, a, b, _, byte_target in PAIRS:
        if byte_target is None or a not in counters or b not in counters:
            continue
        key, target = byte_target
        ratio = counters[a][key] / counters[b][key]
        print(f"  {title}: {key} bytes {ratio:.3f}x (target <= {target:.2f}x: {'OK' if ratio <= target else 'MISSED'})")


def step_verdict(paired: float, target: float | None) -> str:
    """A speed-up target (ratio <= target), or for None no change: within 2 points of 1."""
    if target is None:
        return f"step {'OK' if abs(paired - 1) <= 0.02 else 'MISSED'} (|1 - ratio| <= 0.02)"
    return f"step {'OK' if paired <= target else 'MISSED'} (<= {target:.2f})"


def prediction_verdict(title: str, predicted: float, paired: float) -> str:
    """Within 10% of the measured ratio; for Commshift, whose gain is a few points, within 2 points."""
    if title.startswith("Commshift"):
        return f"{'OK' if abs(predicted - paired) <= 0.02 else 'MISSED'} (gap <= 2 points)"
    return f"{'OK' if abs(predicted / paired - 1) <= 0.10 else 'MISSED'} (within 10%)"


def print_times(results: list[dict], hardware, *, bandwidth: str, repeats: int, prediction: str) -> None:
    """The step-time table; each pair's prediction verdict judges the one declared `prediction` ("profile":
    the profile as measured, or "calibrated": op_overhead_s fitted to the baseline's step), the other
    column is shown for information only. gap: predicted minus measured (paired) ratio, in points."""
    times = step_times_by_plan(results)
    names = sorted({n for n, _ in times}, key=list(PLANS).index)
    workloads = sorted({PLANS[n][2] for n in names})
    print(f"Step times on the emulated clusters (inter-node NIC {bandwidth}), "
          + ", ".join(f"{w}: {WORKLOADS[w][0].name} seq {WORKLOADS[w][1]}" for w in workloads)
          + f", {repeats} interleaved repeats x {len(next(iter(times.values()))[0])} timed steps; ratio = technique / baseline:")
    print(f"{'pair':<24} {'nodes':>5} {'tech s':>8} {'base s':>8} {'ratio':>7} {'paired':>7}  "
          f"{'pred':>6} {'gap':>6}  {'cal pred':>8} {'gap':>6}  verdicts")
    for i, (title, a, b, target, _) in enumerate(PAIRS):
        if (a, i) not in times or (b, i) not in times:
            continue
        ta, tb, ratio, paired = ratios(times, (a, i), (b, i))
        pred = predicted_step_s(hardware, a) / predicted_step_s(hardware, b)
        calibrated = calibrated_on(hardware, b, tb)
        cal = predicted_step_s(calibrated, a) / predicted_step_s(calibrated, b)
        judged = pred if prediction == "profile" else cal
        print(f"{title:<24} {PLANS[a][0]:>5} {ta:>8.3f} {tb:>8.3f} {ratio:>7.3f} {paired:>7.3f}  "
              f"{pred:>6.3f} {100 * (pred - paired):>+6.1f}  {cal:>8.3f} {100 * (cal - paired):>+6.1f}  "
              f"{step_verdict(paired, target)}, {prediction} prediction {prediction_verdict(title, judged, paired)}")
    print(f"pred: the profile as measured; cal pred: with op_overhead_s fitted to the baseline's measured step "
          f"(calibrated_on). The prediction verdict judges {prediction!r} only. Predicted step seconds (as measured): "
          + ", ".join(f"{n} {predicted_step_s(hardware, n):.3f}" for n in names))


def load_or_measure_profile(args):
    """The --profile JSON, or a quick profile measured on the (up) 2 x 2 cluster and saved beside it."""
    from specs.jsonio import write_json_atomic
    from specs.hardware import resolve_hardware
    from planner.profiling import measure_profile
    from profilers.profile import ProfileOptions

    from profilers.profile import QUICK_SIZES_BYTES
    from runners.netns_cluster import parse_rate_bits_per_s

    if args.profile and Path(args.profile).exists():
        return resolve_hardware(args.profile)
    # Messages up to what the shaped NIC moves in half a second (all of --quick's 16 MiB at 1 gbit, 1 MiB
    # at 20 mbit, still above the largest message of the Commshift workload): a quick profile stays quick.
    cap_bytes = parse_rate_bits_per_s(args.bandwidth) / 8 * 0.5
    sizes = tuple(s for s in QUICK_SIZES_BYTES if s <= cap_bytes) or QUICK_SIZES_BYTES[:2]
    hw = measure_profile(ProfileOptions(quick=True, cluster_prefix=PREFIX, sizes_bytes=sizes))
    if args.profile:
        write_json_atomic(Path(args.profile), hw.to_dict())
    return hw


def run_shape(shape: str, args, *, need_profile: bool):
    """Bring up the emulated cluster `shape`, (profile it,) run its pairs interleaved, tear it down."""
    from runners import netns_cluster as nc

    num_nodes, per_node = SHAPES[shape]
    nc.down(prefix=PREFIX)
    nc.up(num_nodes=num_nodes, procs_per_node=per_node, inter_node_bandwidth=args.bandwidth,
                  inter_node_latency=None, prefix=PREFIX)
    try:
        hardware = load_or_measure_profile(args) if need_profile else None
        jobs = interleaved_jobs(shape, repeats=args.repeats, steps=args.steps, pairs=selected_pairs(args.pairs))
        return (run_jobs(jobs, cluster=PREFIX) if jobs else []), hardware
    finally:
        nc.down(prefix=PREFIX)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bandwidth", default="1gbit", help="inter-node NIC rate (tc syntax)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3, help="steps per run; the first is dropped")
    parser.add_argument("--profile", help="profile JSON of the 2 x 2 emulated cluster: read if it exists, else "
                        "measured (quick) and written there")
    parser.add_argument("--shapes", default="2x2,4x1", help="which emulated clusters to time")
    parser.add_argument("--pairs", default="maz3,lins,commshift",
                        help="which pairs to run: comma-separated words matched against the pair titles")
    parser.add_argument("--local-only", action="store_true", help="byte counters only, no emulated cluster")
    parser.add_argument("--results", help="also write the raw per-run step times and counters (JSON) here")
    parser.add_argument("--analyse", help="print the step-time table of a --results file (with --profile), no runs")
    parser.add_argument("--prediction", choices=("profile", "calibrated"), default="profile",
                        help="the one prediction each verdict judges: the profile as measured (default), or with "
                        "op_overhead_s fitted to the baseline's measured step")
    args = parser.parse_args()

    if args.analyse:
        from specs.hardware import resolve_hardware

        print_times(json.loads(Path(args.analyse).read_text()), resolve_hardware(args.profile),
                    bandwidth=args.bandwidth, repeats=args.repeats, prediction=args.prediction)
        return 0
    pairs = selected_pairs(args.pairs)
    if not pairs:
        parser.error(f"--pairs {args.pairs!r} matches none of: {', '.join(p[0] for p in PAIRS)}")
    names = [n for n in PLANS if any(n in PAIRS[i][1:3] for i in pairs)]
    byte_jobs = [(f"{name}|0|0", run_config(name, steps=2).to_dict()) for name in names]
    print_bytes(run_jobs(byte_jobs))
    sys.stdout.flush()
    if args.local_only:
        return 0
    results, hardware = [], None
    for shape in args.shapes.split(","):
        if not any(PLANS[PAIRS[i][1]][0] == shape for i in pairs):
            continue
        got, hw = run_shape(shape, args, need_profile=hardware is None)
        results.extend(got)
        hardware = hardware or hw
    if args.results:
        Path(args.results).write_text(json.dumps(results))
    print_times(results, hardware, bandwidth=args.bandwidth, repeats=args.repeats, prediction=args.prediction)
    return 0


if __name__ == "__main__":
    sys.exit(main())
