"""sudo python benchmarks/wire_bytes.py [--steps 2,6] [--plans zero0,zero3,...] [--bandwidth 1gbit]

The bytes that actually crossed the emulated inter-node link, beside the engine's modelled counters.

Every figure of the byte tables in README.md under "modelled" comes from runners/comm.py: each collective
counts (n - 1)/n (all-gather, reduce-scatter) or 2(n - 1)/n (all-reduce) of its size per rank, split
between intra- and inter-node by the edges of a ring over the group's ranks. This script measures what
the kernel saw instead: the emulated cluster (runners/netns_cluster.py, 2 network-namespace nodes of 2
processes, needs root) runs each plan twice, for S1 and S2 steps, reading the byte counters of every
node's veth NIC before and after (runners.netns_cluster.link_counters; the sum of tx over the nodes
counts every byte that crossed once, with its Ethernet, IP and TCP headers and TCP's acknowledgements).
The difference of the two runs divided by S2 - S1 is the measured traffic of one step, free of the
start-up (rendezvous, process groups, the final metrics); beside it, the engine's modelled inter-node
bytes per step (RunSummary.comm_bytes): the ring volume ("inter_node", what the cost model prices) and
the backend's own ("inter_node_wire": torch's gloo runs a reduce-scatter as an all-reduce of the whole
buffer, twice the ring's bytes), and the measured bytes over each.
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

PREFIX = "plwire"
NODES, PER_NODE = 2, 2
SEQ_LEN = 32

PLANS = {
    # dp4 over 2 nodes: every DP group spans both.
    "zero0": Plan(dp=4, micro_batch=1, num_micro_batches=2),
    "zero2": Plan(dp=4, grad_shard=4, optim_shard=4, micro_batch=1, num_micro_batches=2),
    "zero3": Plan(dp=4, param_shard=4, grad_shard=4, optim_shard=4, micro_batch=1, num_micro_batches=2),
    "maz3-device": Plan(dp=4, param_shard=4, grad_shard=4, optim_shard=4, micro_batch=1, num_micro_batches=2,
                        param_cache="device"),
    "lins-2-2-4": Plan(dp=4, param_shard=2, grad_shard=2, optim_shard=4, micro_batch=1, num_micro_batches=2),
    # Megatron order: TP pairs inside a node, the DP pairs (0, 2) and (1, 3) across.
    "tp2-dp2": Plan(dp=2, tp=2, micro_batch=1, num_micro_batches=2),
    # Pipeline stage 0 on node 0, stage 1 on node 1: activations and their gradients cross.
    "pp2-dp2": Plan(dp=2, pp=2, micro_batch=1, num_micro_batches=4),
}


def run_config(name: str, *, steps: int):
    from runners.config import RunConfig

    plan = PLANS[name]
    return RunConfig(plan=plan, model=PRESETS["tiny"], job=Job(global_batch=plan.global_batch, seq_len=SEQ_LEN,
                     precision="fp32"), steps=steps, seed=0, lr=3e-3, ranks_per_node=PER_NODE, timeout_s=600)


def measured_run(name: str, *, steps: int) -> tuple[int, int, dict]:
    """(bytes, packets) the run put on the inter-node link (sum of the nodes' tx), and its comm_bytes."""
    from runners import netns_cluster as nc
    from runners.launch import Where, launch

    state = nc.load_state(PREFIX)
    before = nc.link_counters(state)
    metrics = launch(run_config(name, steps=steps), where=Where(cluster=PREFIX))
    after = nc.link_counters(state)
    deltas = [a - b for a, b in zip(after, before)]
    return sum(d.tx_bytes for d in deltas), sum(d.tx_packets for d in deltas), metrics.summary.comm_bytes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", default="2,6", help="the two step counts S1,S2 whose difference is measured")
    parser.add_argument("--plans", default=",".join(PLANS))
    parser.add_argument("--bandwidth", default=None, help="shape the inter-node NIC (tc syntax); default unshaped")
    args = parser.parse_args()
    s1, s2 = (int(x) for x in args.steps.split(","))
    names = args.plans.split(",")
    unknown = [n for n in names if n not in PLANS]
    if unknown or not 0 < s1 < s2:
        print(f"error: unknown plan {unknown[0]}" if unknown else "error: --steps needs 0 < S1 < S2", file=sys.stderr)
        return 2
    from runners import netns_cluster as nc

    nc.down(prefix=PREFIX)
    nc.up(num_nodes=NODES, procs_per_node=PER_NODE, inter_node_bandwidth=args.bandwidth, inter_node_latency=None,
          prefix=PREFIX)
    try:
        print(f"tiny model, seq {SEQ_LEN}, {NODES} nodes x {PER_NODE} processes; per step = (run of {s2} steps - "
              f"run of {s1}) / {s2 - s1}")
        print(f"{'plan':<12} {'modelled ring B':>16} {'modelled wire B':>16} {'measured B':>12} {'/ ring':>7} "
              f"{'/ wire':>7} {'packets':>8} {'B/packet':>9} {'start-up B':>11}")
        for name in names:
            b1, p1, _ = measured_run(name, steps=s1)
            b2, p2, counted = measured_run(name, steps=s2)
            per_step, packets = (b2 - b1) / (s2 - s1), (p2 - p1) / (s2 - s1)
            ring, wire = counted["inter_node"], counted["inter_node_wire"]
            startup = b1 - s1 * per_step
            print(f"{name:<12} {ring:>16,} {wire:>16,} {per_step:>12,.0f} {per_step / ring:>7.3f} "
                  f"{per_step / wire:>7.3f} {packets:>8.0f} {per_step / packets:>9.0f} {startup:>11,.0f}")
    finally:
        nc.down(prefix=PREFIX)
    return 0


if __name__ == "__main__":
    sys.exit(main())
