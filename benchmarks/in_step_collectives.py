"""A collective as a training step calls it (after compute) against as the profile times it (after a barrier).

    python benchmarks/in_step_collectives.py                 # 4 processes, 16 KB, 2-rank groups
    python benchmarks/in_step_collectives.py --nproc 2
    python benchmarks/in_step_collectives.py --group-size 4 --bytes 524288 --burst 512   # one 4-rank group

`planner profile` (profilers/comm.py) times every point after a barrier: every rank awake and aligned. A
step calls its collectives between computations, so a rank arrives while its partner may still compute or
wait for a core. This measures both on the same ranks, interleaved in rounds (medians kept): "in step" is a
loop of a short matmul then the op, minus the loop of the matmul alone; "profile" is the op's median time
after a barrier. The groups are the groups of `--group-size` consecutive ranks (2: a tp2 layout), all
active at once, as in a plan; `--burst` sets the compute between ops (a longer segment lets the ranks drift
further apart before they must meet). Ops: all-reduce, all-gather, reduce-scatter, all-to-all, a ring step (irecv from one
neighbour and isend to the other at once: context parallelism's K/V exchange) and a send with its receive
(a pipeline boundary; the profile's p2p). Prints one line per op with both times and their ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _worker(rank: int, world: int, port: int, args, queue) -> None:
    import torch
    import torch.distributed as dist

    from runners.comm import all_gather_single, reduce_scatter_single

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    size = args.group_size
    groups = [dist.new_group(list(range(r, r + size))) for r in range(0, world, size)]
    group, peer, base = groups[rank // size], rank ^ 1, rank - rank % size
    nxt, prev = base + (rank - base + 1) % size, base + (rank - base - 1) % size
    numel = args.bytes // 4 // size * size
    full, part = torch.ones(numel), torch.ones(numel // size)
    out, received = torch.empty(numel), torch.empty(numel)
    a = torch.randn(args.burst, args.burst)
    ops = {
        "all_reduce": lambda: dist.all_reduce(full, group=group),
        "all_gather": lambda: all_gather_single(full, part, group=group),
        "reduce_scatter": lambda: reduce_scatter_single(part, full, group=group),
        "all_to_all": lambda: dist.all_to_all_single(out, full, group=group),
        "ring step": lambda: [w.wait() for w in (dist.irecv(received, src=prev, group=group),
                                                 dist.isend(full, dst=nxt, group=group))],
        "send + recv": ((lambda: dist.send(full, dst=peer, group=group)) if rank % 2 == 0
                        else (lambda: dist.recv(received, src=peer, group=group))),
    }

    def loop(op, *, end_barrier: bool = True) -> float:
        dist.barrier()
        start = time.perf_counter()
        for _ in range(args.repeats):
            torch.mm(a, a)
            if op is not None:
                op()
        if end_barrier:
            dist.barrier()
        return (time.perf_counter() - start) / args.repeats

    def after_barrier(op) -> float:
        times = []
        for _ in range(args.repeats // 4):
            dist.barrier()
            start = time.perf_counter()
            op()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    samples: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        compute, own = loop(None), loop(None, end_barrier=False)
        samples.setdefault("compute", []).append(compute)
        for name, op in ops.items():
            with_op = loop(op)
            samples.setdefault(f"{name}|step", []).append(with_op - compute)
            samples.setdefault(f"{name}|own", []).append(with_op - own)
            samples.setdefault(f"{name}|profile", []).append(after_barrier(op))
    result = {k: statistics.median(v) for k, v in samples.items()}
    slowest = torch.tensor([result[k] for k in sorted(result)], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    if rank == 0:
        queue.put(dict(zip(sorted(result), slowest.tolist())))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=4, help="processes (even)")
    parser.add_argument("--bytes", type=int, default=16384, help="message bytes (a tiny model's activation)")
    parser.add_argument("--burst", type=int, default=96, help="square matmul size between ops")
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--group-size", type=int, default=2, help="ranks per group (even, dividing --nproc)")
    args = parser.parse_args(argv)
    if args.nproc < 2 or args.nproc % 2:
        parser.error("--nproc must be even and at least 2")
    if args.group_size < 2 or args.group_size % 2 or args.nproc % args.group_size:
        parser.error("--group-size must be even, at least 2, and divide --nproc")
    import torch.multiprocessing as mp

    from runners.launch import free_port

    port = free_port()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    procs = [ctx.Process(target=_worker, args=(r, args.nproc, port, args, queue)) for r in range(args.nproc)]
    for p in procs:
        p.start()
    result = queue.get(timeout=1800)
    for p in procs:
        p.join()
    print(f"{args.nproc} processes on {os.cpu_count()} cores, {args.bytes} bytes, {args.group_size}-rank groups; "
          f"compute between ops {result['compute'] * 1e3:.2f} ms (slowest rank, medians of {args.rounds} rounds)")
    print("in step: the op loop less the compute loop of the slowest rank; vs own: less each rank's own compute")
    print("loop (the wait for ranks that drifted behind over the segment counted in; the slowest rank's figure)")
    print(f"{'op':16s} {'in step ms':>10s} {'vs own ms':>10s} {'profiled ms':>11s} {'ratio':>6s}")
    for name in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "ring step", "send + recv"):
        step, own, profiled = result[f"{name}|step"], result[f"{name}|own"], result[f"{name}|profile"]
        print(f"{name:16s} {step * 1e3:10.2f} {own * 1e3:10.2f} {profiled * 1e3:11.2f} {step / profiled:6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
