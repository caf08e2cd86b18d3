"""python benchmarks/engine_before_after.py [--baseline 0041d03] [--rounds 3] [--steps 4]
python benchmarks/engine_before_after.py --fresh ZeRO-3 [--rounds 10] [--steps 12]

This engine now against the same engine at an older commit, side by side in one run: the "no worse than
before" check of a restructure (the one-house issue: `--baseline 0041d03` is the last commit before the
shared types moved to specs/ and the engine was split by technique).

Each round runs `benchmarks/engine_vs_torch.py --no-memory --repeats 1` once from the baseline's tree (a
detached git worktree in a temporary folder, its own code first on sys.path) and once from this tree,
alternating which goes first, so drift in a shared machine's load lands on both. Every run times DDP and
ZeRO-1/2/3 for our engine and torch's own components on 4 gloo CPU processes. Printed per plan:

  ours now / ours before   our engine's median step time now over the baseline's (the restructure's cost)
  ratio now, ratio before  ours / torch within each run (torch's components are the same code in both
                           runs, so each ratio is measured against the same yardstick at the same moment)
  the same in CPU seconds  summed over the ranks (getrusage): the engine's work, steadier than wall time
                           on a shared host, blind to time blocked on a peer

Medians over rounds; "no worse" means ours now / ours before <= 1 within the rounds' spread, and the
ours / torch ratio now no higher than before.

`--fresh PLAN` times one plan of our engine alone, each run on a fresh set of processes: the default
runs every plan in order in one set of processes, and a later plan there inherits what the earlier ones
left (allocator state, resident memory): ZeRO-3, run last, reads ~1.4x slower there than alone, in both
trees, so its ratio carries the most of that noise. Each round runs the plan once per tree (order
alternating); printed: the median over rounds of the paired ratios now / before of the median step
time (wall, rank 0) and of the CPU seconds per step summed over the ranks, with their range, and in
how many rounds now was the faster.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PLANS = ("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3")
# plan, ours s, torch s, ours/torch, paired, n, ours cpu-s, torch cpu-s, cpu ratio
_ROW = re.compile(r"^(DDP|ZeRO-[123])\s+([0-9.]+)\s+([0-9.]+)\s+[0-9.]+\s+[0-9.]+\s+\d+\s+([0-9.]+)\s+([0-9.]+)")


def run_tree(tree: Path, *, steps: int) -> dict[str, tuple[float, float, float, float]]:
    """{plan: (ours s, torch s, ours CPU-s, torch CPU-s)} from one engine_vs_torch run of `tree`'s code."""
    cmd = [sys.executable, str(tree / "benchmarks" / "engine_vs_torch.py"), "--no-memory", "--repeats", "1",
           "--steps", str(steps)]
    out = subprocess.run(cmd, cwd=tree, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(tree)})
    if out.returncode != 0:
        raise SystemExit(f"engine_vs_torch failed in {tree} (exit {out.returncode}):\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
    rows = {}
    for line in out.stdout.splitlines():
        match = _ROW.match(line)
        if match:
            rows[match.group(1)] = tuple(float(match.group(i)) for i in range(2, 6))
    if set(rows) != set(PLANS):
        raise SystemExit(f"could not read the step-time table of {tree}:\n{out.stdout[-2000:]}")
    return rows


def run_fresh(tree: Path, *, level: int, steps: int) -> tuple[float, float]:
    """(median step wall seconds on rank 0, CPU seconds per step summed over ranks) of our engine running
    ZeRO-`level` (0: DDP) alone on 4 fresh processes with `tree`'s code; the first step is dropped."""
    worker = ROOT / "benchmarks" / "fresh_plan.py"
    out = subprocess.run([sys.executable, str(worker), str(tree), str(level), str(steps)], cwd=tree,
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(tree)})
    line = next((l for l in out.stdout.splitlines() if l.startswith("FRESH ")), None)
    if out.returncode != 0 or line is None:
        raise SystemExit(f"the fresh run failed in {tree} (exit {out.returncode}):\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
    wall, cpu = (float(x) for x in line.split()[1:])
    return wall, cpu


def compare_fresh(base: Path, *, plan: str, rounds: int, steps: int) -> None:
    level = PLANS.index(plan)
    pairs = []
    for r in range(rounds):
        order = [("before", base), ("now", ROOT)] if r % 2 == 0 else [("now", ROOT), ("before", base)]
        got = {which: run_fresh(tree, level=level, steps=steps) for which, tree in order}
        pairs.append(got)
        print(f"round {r + 1}/{rounds}: now {got['now'][0] * 1e3:.0f} ms, before {got['before'][0] * 1e3:.0f} ms",
              file=sys.stderr, flush=True)
    print(f"{plan} alone on fresh processes, {rounds} rounds x {steps} steps, alternating; now / before:")
    for i, what in ((0, "wall (rank 0 median step)"), (1, "CPU seconds per step (all ranks)")):
        ratios = [p["now"][i] / p["before"][i] for p in pairs]
        faster = sum(x < 1 for x in ratios)
        print(f"  {what:<34} median {statistics.median(ratios):.3f} ({min(ratios):.2f}-{max(ratios):.2f}), "
              f"now faster in {faster} of {rounds}")


def main() -> None:
    parser = argparse.ArgumentParser(prog="engine_before_after")
    parser.add_argument("--baseline", default="0041d03", help="the commit to compare against")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4, help="steps per run; the first is dropped")
    parser.add_argument("--fresh", choices=PLANS, help="time this plan of our engine alone on fresh processes")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="planner-baseline-") as tmp:
        base = Path(tmp) / "tree"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(base), args.baseline],
                       check=True, capture_output=True)
        try:
            if args.fresh:
                compare_fresh(base, plan=args.fresh, rounds=args.rounds, steps=args.steps)
                return
            before: list[dict] = []
            now: list[dict] = []
            for r in range(args.rounds):
                order = [("before", base), ("now", ROOT)] if r % 2 == 0 else [("now", ROOT), ("before", base)]
                for which, tree in order:
                    (before if which == "before" else now).append(run_tree(tree, steps=args.steps))
                    print(f"round {r + 1}/{args.rounds}: {which} done", file=sys.stderr, flush=True)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)], capture_output=True)
    print(f"baseline {args.baseline}, {args.rounds} rounds, alternating; medians over rounds (min-max)")
    print(f"{'plan':<8} {'wall: ours now/before':>24} {'ratio now':>10} {'before':>7}   "
          f"{'CPU: ours now/before':>24} {'ratio now':>10} {'before':>7}")
    for plan in PLANS:
        cells = []
        for ours, theirs in ((0, 1), (2, 3)):
            speed = [n[plan][ours] / b[plan][ours] for n, b in zip(now, before)]
            r_now = statistics.median(n[plan][ours] / n[plan][theirs] for n in now)
            r_before = statistics.median(b[plan][ours] / b[plan][theirs] for b in before)
            cells.append(f"{statistics.median(speed):>11.3f} ({min(speed):.2f}-{max(speed):.2f}) "
                         f"{r_now:>10.3f} {r_before:>7.3f}")
        print(f"{plan:<8} {cells[0]}   {cells[1]}")

if __name__ == "__main__":
    main()
