"""From the loss of a node to the first step under the new plan, in stages; and the way back up.

    sudo python benchmarks/elastic.py [--rounds 2] [--steps 80]

On the emulated cluster (2 network-namespace nodes x 2 processes, prefix "plelastic"), an elastic run of
the tiny model (`planner run --cluster --elastic 1:2 --hardware cpu`, checkpoint every 5 steps) has node 1
SIGKILLed whole at step 12; once the shrunk run has trained a few steps, node 1 comes back. Reported
per change, from the launcher's clock and the workers' event stamps (one host, one clock):

- detect: the fault -> the first rank's broken collective (the `lost` event);
- restart: -> the new world's workers are up (agents stopped the old ones, the rendezvous closed
  without the lost node, torchrun started workers, the process group formed: the `replanned` event);
- re-plan: the plan look-up for the new world size (the table was searched before the launch; its
  search time is printed once);
- resume: -> the newest complete checkpoint is loaded under the new plan (`resumed`);
- first step: -> the first step under the new plan has finished;
- total: the fault -> the first new step (target: under 30 s on this machine).

The cluster is removed at the end, also on failure.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time
from pathlib import Path

from runners import netns_cluster as nc

PREFIX = "plelastic"
CHECKPOINT_EVERY = 5


class _Driver:
    """Kill node 1 at `kill_at`; bring it back `rejoin_after` steps into the shrunk run; record times."""

    def __init__(self, *, kill_at: int, rejoin_after: int) -> None:
        self.kill_at, self.rejoin_after = kill_at, rejoin_after
        self.nodes = None
        self.world = 4
        self.kill_wall_s = self.rejoin_wall_s = None
        self.changes: list = []
        self.first_step_wall_s: dict[int, float] = {}  # resumed step -> wall time its first step finished
        self.pending_resume: int | None = None
        self.steps_in_world = 0

    def on_step(self, record: dict) -> None:
        if self.pending_resume is not None and record["step"] == self.pending_resume:
            self.first_step_wall_s[len(self.first_step_wall_s)] = record["time"]
            self.pending_resume = None
        self.steps_in_world += 1
        if self.kill_wall_s is None and self.world == 4 and record["step"] >= self.kill_at:
            self.kill_wall_s = time.time()
            self.nodes.kill(1)
        elif self.world == 2 and self.rejoin_wall_s is None and self.steps_in_world >= self.rejoin_after:
            self.rejoin_wall_s = time.time()
            threading.Thread(target=self.nodes.rejoin, args=(1,), daemon=True).start()

    def on_change(self, event) -> None:
        self.changes.append(event)
        if event.kind == "replanned":
            self.world, self.steps_in_world = event.world_size, 0
        if event.kind == "resumed":
            self.pending_resume = event.step


def _stages(driver: _Driver, *, start_wall_s: float) -> list[dict]:
    """Seconds per stage for the shrink (from the kill) and the growth (from the node's return)."""
    wall = {id(e): start_wall_s + e.time_s for e in driver.changes}
    out = []
    resumes = [e for e in driver.changes if e.kind == "resumed"]
    for i, resumed in enumerate(resumes):
        before = driver.changes[:driver.changes.index(resumed)]
        replanned = [e for e in before if e.kind == "replanned"][-1]
        fault_s = driver.kill_wall_s if i == 0 else driver.rejoin_wall_s
        seen = [e for e in before if e.kind == ("lost" if i == 0 else "scaled_up")][-1]
        first_s = driver.first_step_wall_s.get(i)
        out.append({"change": "shrink 4 -> 2" if i == 0 else "grow 2 -> 4",
                    "detect_s": wall[id(seen)] - fault_s, "restart_s": wall[id(replanned)] - wall[id(seen)],
                    "resume_s": wall[id(resumed)] - wall[id(replanned)],
                    "first_step_s": (first_s - wall[id(resumed)]) if first_s else float("nan"),
                    "total_s": (first_s - fault_s) if first_s else float("nan"), "steps_lost": resumed.steps_lost})
    return out


def one_round(*, steps: int, tmp: Path) -> tuple[list[dict], float, float]:
    from planner.run_command import RunRequest, build_run
    from runners.launch import launch

    request = RunRequest(model="tiny", hardware="cpu", global_batch=8, seq_len=64, precision="fp32", steps=steps,
                         nproc=2, nnodes=1, checkpoint_dir=str(tmp / "ckpt"), checkpoint_every=CHECKPOINT_EVERY,
                         max_restarts=3, cluster=PREFIX, elastic="1:2")
    start = time.perf_counter()
    cfg = build_run(request, {})
    table_s = time.perf_counter() - start
    lookup_start = time.perf_counter()
    cfg.for_world(2)
    lookup_s = time.perf_counter() - lookup_start
    driver = _Driver(kill_at=12, rejoin_after=5)
    start_wall_s = time.time()
    launch(cfg, where=request.where(), on_step=driver.on_step, on_change=driver.on_change,
           on_nodes=lambda nodes: setattr(driver, "nodes", nodes), env={"OMP_NUM_THREADS": "1"})
    return _stages(driver, start_wall_s=start_wall_s), table_s, lookup_s


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--steps", type=int, default=80)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="plelastic-bench-") as tmp:
        os.environ["PLANNER_CLUSTER_STATE_DIR"] = str(Path(tmp) / "state")
        nc.down(prefix=PREFIX)
        nc.up(num_nodes=2, procs_per_node=2, inter_node_bandwidth=None, inter_node_latency=None, prefix=PREFIX)
        try:
            for r in range(args.rounds):
                rows, table_s, lookup_s = one_round(steps=args.steps, tmp=Path(tmp) / f"round{r}")
                print(f"round {r + 1}: plan table for 2 and 4 processes searched before the launch in {table_s:.2f} s; "
                      f"re-plan (look-up) {lookup_s * 1e6:.0f} us")
                for row in rows:
                    if row["change"].startswith("grow"):  # the node's start, rendezvous and restart are one stage
                        head = f"node start + rendezvous + restart {row['detect_s'] + row['restart_s']:.1f} s"
                    else:
                        head = f"detect {row['detect_s']:.1f} s, restart {row['restart_s']:.1f} s"
                    print(f"  {row['change']}: {head}, re-plan {lookup_s:.4f} s, resume {row['resume_s']:.1f} s, first "
                          f"step {row['first_step_s']:.1f} s -> total {row['total_s']:.1f} s ({row['steps_lost']} steps "
                          f"lost)" + ("" if row["change"].startswith("grow") else
                                      f"  [target < 30 s: {'OK' if row['total_s'] < 30 else 'OVER'}]"))
        finally:
            nc.down(prefix=PREFIX)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
