"""Issue 4's check: with a fresh profile alone (no `planner calibrate`), `planner estimate` of DP and ZeRO
plans of the tiny model against `planner run`'s measured median step time on the same local processes.

    python benchmarks/profile_vs_run.py [--nproc 4] [--rounds 2] [--out-dir out/profile_vs_run]

1. `planner profile --quick --nproc N`: collectives per group size, GEMM/bandwidth sweeps, and the layer
   and overlap probes that fit the CPU's per-op cost, compute slowdown and overlap (runners/probe.py);
2. every plan (ZeRO-0..3 over dp N, micro-batch 1 x N and N x 1, and ZeRO-0 at 1 x N under selective and
   full recomputation; global batch 16, sequence 64) runs
   `--rounds` times, plans interleaved so load drift hits all alike; the median of the runs' medians is
   the measurement and the run's own "predicted" block (the profile's estimate) the prediction;
3. prints one row per plan (relative error = predicted / measured - 1) and how many are within 20%.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

TARGET = 0.20


def run(cmd: list[str]) -> None:
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({result.returncode}): {result.stderr.strip()[-400:]}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--profile", help="reuse this profile instead of measuring one")
    parser.add_argument("--out-dir", default="out/profile_vs_run")
    args = parser.parse_args()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    profile = Path(args.profile) if args.profile else out / "profile.json"
    if not args.profile:
        start = time.perf_counter()
        run(["planner", "profile", "--quick", "--nproc", str(args.nproc), "--out", str(profile)])
        print(f"profile --quick --nproc {args.nproc}: {time.perf_counter() - start:.1f} s", flush=True)
    calibration = json.loads(profile.read_text())["calibration"]
    print("probe-fitted:", ", ".join(f"{k} {v:.4g}" for k, v in sorted(calibration.items())), flush=True)
    n = args.nproc
    plans = [(z, mb, "none") for z in range(4) for mb in (1, n)] + [(0, 1, "selective"), (0, 1, "full")]
    measured: dict[tuple, list[float]] = {p: [] for p in plans}
    predicted: dict[tuple, float] = {}
    for r in range(args.rounds):
        for z, mb, rc in (plans if r % 2 == 0 else plans[::-1]):
            metrics = out / f"zero{z}-mb{mb}-{rc}-r{r}.json"
            run(["planner", "run", "--nproc", str(n), "--dp", str(n), "--zero", str(z), "--micro-batch", str(mb),
                 "--recompute", rc, "--global-batch", "16", "--seq-len", "64", "--steps", str(args.steps),
                 "--hardware", str(profile), "--format", "json", "--metrics-out", str(metrics)])
            data = json.loads(metrics.read_text())
            measured[(z, mb, rc)].append(data["summary"]["median_step_time_s"])
            predicted[(z, mb, rc)] = data["predicted"]["step_time_s"]
    print(f"{'plan':<28}{'measured s':>12}{'predicted s':>13}{'error':>9}")
    errors = []
    for key in plans:
        z, mb, rc = key
        m = statistics.median(measured[key])
        e = predicted[key] / m - 1
        errors.append(e)
        name = f"ZeRO-{z} mb {mb}x{16 // n // mb}" + ("" if rc == "none" else f" recompute {rc}")
        print(f"{name:<28}{m:>12.4f}{predicted[key]:>13.4f}{e:>+9.1%}")
    within = sum(abs(e) <= TARGET for e in errors)
    print(f"within {TARGET:.0%}: {within} of {len(errors)}; mean |error| {statistics.fmean(abs(e) for e in errors):.1%}, "
          f"worst {max(errors, key=abs):+.1%}")
    (out / "summary.json").write_text(json.dumps({"calibration": calibration, "plans": [
        {"zero": z, "micro_batch": mb, "recompute": rc, "measured_s": measured[(z, mb, rc)],
         "predicted_s": predicted[(z, mb, rc)]} for z, mb, rc in plans], "within": within}, indent=1))
    return 0 if within == len(errors) else 1


if __name__ == "__main__":
    sys.exit(main())
