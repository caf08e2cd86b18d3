"""Profile targets in one run: shaped inter-node bandwidth recovered, intra-node separate, --quick time.

    sudo python benchmarks/profile_emulated.py --bandwidth 1gbit --latency 1ms

1. Times `planner profile --quick` (2 local processes) against the 120 s budget.
2. Brings up an emulated cluster (2 nodes x 2 processes, inter-node NIC shaped to --bandwidth), runs the
   quick profile's collectives on it, and compares the fitted inter-node bandwidth with the shaped rate
   (target: within 15%) and with the intra-node bandwidth measured in the same run.
The cluster is removed at the end, also on failure.
"""

from __future__ import annotations

import argparse
import logging
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from planner.profiling import measure_profile
from profilers.profile import ProfileOptions
from runners import netns_cluster as nc

PREFIX = "plbench"


def time_quick_profile() -> float:
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        subprocess.run(["planner", "profile", "--quick", "--nproc", "2", "--out", str(Path(tmp) / "p.json"),
                        "--format", "json"], check=True, stdout=subprocess.DEVNULL)
        return time.perf_counter() - start


def profile_cluster(args: argparse.Namespace) -> dict:
    nc.down(prefix=PREFIX)
    state = nc.up(num_nodes=args.nodes, procs_per_node=args.procs_per_node, inter_node_bandwidth=args.bandwidth,
                  inter_node_latency=args.latency, prefix=PREFIX)
    try:
        start = time.perf_counter()
        hw = measure_profile(ProfileOptions(quick=True, cluster_prefix=PREFIX))
        return {"state": state, "hw": hw, "wall_s": time.perf_counter() - start}
    finally:
        nc.down(prefix=PREFIX)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bandwidth", default="1gbit")
    parser.add_argument("--latency", default="1ms")
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--procs-per-node", type=int, default=2)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    quick_s = time_quick_profile()
    print(f"planner profile --quick (2 processes, loopback): {quick_s:.1f} s (budget 120 s) "
          f"{'OK' if quick_s <= 120 else 'OVER'}")

    result = profile_cluster(args)
    state, hw = result["state"], result["hw"]
    shaped_bytes_per_s = state.inter_node_bandwidth_bits_per_s / 8
    inter, intra = hw.inter_node, hw.intra_node
    error = inter.bandwidth_bytes_per_s / shaped_bytes_per_s - 1
    print(f"emulated cluster: {state.num_nodes} nodes x {state.procs_per_node} procs, inter-node NIC "
          f"{args.bandwidth} = {shaped_bytes_per_s / 1e6:.1f} MB/s, latency {args.latency} "
          f"({'emulated' if state.latency_emulated else 'NOT emulated: kernel has no sch_netem'}); "
          f"collective profile took {result['wall_s']:.1f} s")
    print(f"fitted inter-node (2-rank p2p): {inter.bandwidth_bytes_per_s / 1e6:.1f} MB/s ({error:+.1%} vs shaped; "
          f"target within 15%: {'OK' if abs(error) <= 0.15 else 'FAIL'}), latency {inter.latency_s * 1e6:.0f} us")
    print(f"fitted intra-node (2-rank p2p): {intra.bandwidth_bytes_per_s / 1e6:.1f} MB/s, latency "
          f"{intra.latency_s * 1e6:.0f} us = {intra.bandwidth_bytes_per_s / inter.bandwidth_bytes_per_s:.1f}x inter-node")
    print(f"{'collective':15s} {'link':11s} {'group':>5s} {'latency us':>11s} {'bus MB/s':>9s}")
    for fit in hw.collectives:
        print(f"{fit.collective:15s} {fit.link:11s} {fit.group_size:5d} {fit.latency_s * 1e6:11.0f} "
              f"{fit.bandwidth_bytes_per_s / 1e6:9.1f}")
    return 0 if abs(error) <= 0.15 and quick_s <= 120 else 1


if __name__ == "__main__":
    sys.exit(main())
