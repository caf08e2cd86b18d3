"""Collective benchmark worker, one process per rank under torchrun (gloo on CPU, NCCL on CUDA).

    python -m torch.distributed.run --nproc-per-node 2 -m profilers.comm --work-dir DIR   (DIR/spec.json: CommSpec)

`planner profile` launches this through runners.launch with the spec (sizes, collectives and the
process groups to measure); rank 0 returns one curve per (group, collective). An inter-node group is measured
alone, the other ranks idling in step, so its curve is the link's own speed. An intra-node shape is
measured on all its copies at once (every block of consecutive ranks of its size: each node's groups,
and the other groups inside a node), the slowest copy kept: in a training step every node's tensor- or
data-parallel groups communicate at the same time, so on a real cluster nothing changes, while on one
machine emulating several nodes (runners/netns_cluster.py) the nodes share the host's cores and this
is the speed a step sees. A failing rank is named by the launcher (runners.launch.worker_main).
"""

from __future__ import annotations

import datetime
import os
import statistics
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from runners.launch import emit_event

ELEMENT_BYTES = 4  # float32 payloads: the byte count, not the dtype, sets a collective's time


@dataclass(frozen=True)
class GroupShape:
    """A process group to measure: `link` is the class its traffic crosses (intra_node or inter_node)."""

    name: str
    link: str
    ranks: tuple[int, ...]


def plan_groups(*, world_size: int, ranks_per_node: int, quick: bool) -> list[GroupShape]:
    """The group shapes plans use, each as the group that contains rank 0.

    Inside a node: consecutive ranks (tensor parallel), sizes 2, 4, ... up to the node. Across nodes:
    one rank per node (data or pipeline parallel over nodes), sizes 2, 4, ... up to the node count.
    Both: the whole world when nodes hold several ranks. --quick keeps the smallest and largest sizes.
    """
    if world_size % ranks_per_node:
        raise ValueError(f"{world_size} processes do not split into nodes of {ranks_per_node}")
    num_nodes = world_size // ranks_per_node

    def sizes(limit: int) -> list[int]:
        out = sorted({s for s in (2 ** i for i in range(1, 20)) if s <= limit} | ({limit} if limit >= 2 else set()))
        return sorted({out[0], out[-1]}) if quick and out else out

    shapes = [GroupShape(f"intra{s}", "intra_node", tuple(range(s))) for s in sizes(ranks_per_node)]
    shapes += [GroupShape(f"inter{s}", "inter_node", tuple(i * ranks_per_node for i in range(s)))
               for s in sizes(num_nodes)]
    if num_nodes >= 2 and ranks_per_node >= 2:
        shapes.append(GroupShape(f"both{world_size}", "inter_node", tuple(range(world_size))))
    return shapes


@dataclass(frozen=True)
class CommSpec:
    sizes_bytes: tuple[int, ...]
    collectives: tuple[str, ...]
    groups: tuple[GroupShape, ...]
    budget_s_per_point: float
    max_repeats: int
    timeout_s: float

    def to_dict(self) -> dict:
        return asdict(self)


def _make_op(collective: str, nbytes: int, *, ranks: tuple[int, ...], group, device: torch.device):
    """A closure running one `collective` of `nbytes` message bytes (see profilers.fit.bus_factor)."""
    n = len(ranks)
    numel = nbytes // ELEMENT_BYTES
    me = dist.get_rank()
    full = torch.ones(numel, dtype=torch.float32, device=device)
    part = torch.ones(numel // n, dtype=torch.float32, device=device)
    if collective == "all_reduce":
        return lambda: dist.all_reduce(full, group=group)
    # torch 2.13 renamed the tensor forms (*_single); older releases in our range only have *_tensor.
    if collective == "all_gather":
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return lambda: gather(full, part, group=group)
    if collective == "reduce_scatter":
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return lambda: scatter(part, full, group=group)
    if collective == "broadcast":
        return lambda: dist.broadcast(full, src=ranks[0], group=group)
    if collective == "all_to_all":
        out = torch.empty_like(full)
        return lambda: dist.all_to_all_single(out, full, group=group)
    if collective == "p2p":
        # One message from the group's first rank to its second: a pipeline stage boundary.
        if me == ranks[0]:
            return lambda: dist.send(full, dst=ranks[1], group=group)
        return lambda: dist.recv(full, src=ranks[0], group=group)
    if collective == "ring_step":
        # Every rank sends to the next rank of the group and receives from the previous one at once: one
        # step of context parallelism's K/V ring, through the engine's own exchange (runners/comm.Comm:
        # one batch under NCCL, host-staged CUDA tensors under gloo).
        from runners.comm import Comm

        i = ranks.index(me)
        received, comm = torch.empty_like(full), Comm(ranks_per_node=1, device=device)
        nxt, prev = ranks[(i + 1) % n], ranks[(i - 1) % n]
        return lambda: [w.wait() for w in comm.exchange(full, received, dst=nxt, src=prev, group=group)]
    raise ValueError(f"unknown collective {collective!r}")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# The compute a step runs between two collectives, stood for by one square matmul of this side (~0.1 ms on
# one CPU core, microseconds on a GPU): what matters is that the op is called by ranks coming from work.
BURST_SIDE = 96
ROUNDS = 3


def measure_point(op, *, group, device: torch.device, budget_s: float, max_repeats: int) -> tuple[list[float], int]:
    """Seconds of one `op` as a training step calls it, one value per round, the slowest rank's; and the
    number of calls timed.

    A step does not call its collectives after a barrier: each rank arrives from its own computation, its
    partners a little earlier or later, and on a host with fewer cores than processes one of them may not
    be running. So each round times a loop of k x (a short matmul, then `op`) and a loop of the k matmuls
    alone, every rank starting both after one barrier, and keeps (op loop - fastest matmul loop) / k. Timed after a
    barrier instead (until the eleventh session), a 4-process gloo ring step of 16 KiB measured 1.3 ms where
    steps saw 3.7 ms, a send with its receive 0.65 where they saw 2.9 (benchmarks/in_step_collectives.py).

    Every rank of `group` calls this (in `run`, the whole world: ranks outside the measured groups pass a
    no-op and only compute). The repeat count is agreed across the group from the slowest warm-up so
    every rank calls the collective the same number of times.
    """
    burst = torch.ones(BURST_SIDE, BURST_SIDE, device=device) / BURST_SIDE
    op()
    _sync(device)
    start = time.perf_counter()
    op()
    _sync(device)
    warm = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
    dist.all_reduce(warm, op=dist.ReduceOp.MAX, group=group)
    repeats = int(min(max_repeats, max(ROUNDS, budget_s / max(float(warm.item()), 1e-9))))
    per_round = max(1, repeats // ROUNDS)

    def loop(call) -> float:
        dist.barrier(group=group)
        start = time.perf_counter()
        for _ in range(per_round):
            torch.mm(burst, burst)
            call()
        _sync(device)
        return time.perf_counter() - start

    compute, with_op = [], []
    for _ in range(ROUNDS):
        compute.append(loop(lambda: None))
        with_op.append(loop(op))
    # The matmuls' own time is their fastest loop (noise only adds time); a fast op on a noisy host can still
    # come out at or below zero: floored at a hundredth of a microsecond.
    times = torch.tensor([max(1e-8, (t - min(compute)) / per_round) for t in with_op], dtype=torch.float64,
                         device=device)
    dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group)
    return times.tolist(), ROUNDS * per_round


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def _round_size(nbytes: int, n: int) -> int:
    unit = ELEMENT_BYTES * n
    return max(unit, nbytes // unit * unit)


def copies(shape: GroupShape, world_size: int) -> list[tuple[int, ...]]:
    """The groups measured at once for `shape`: every block of consecutive ranks of its size for an
    intra-node shape (module docstring), the shape's own group otherwise."""
    n = len(shape.ranks)
    if shape.link == "intra_node" and shape.ranks == tuple(range(n)) and world_size % n == 0:
        return [tuple(range(k * n, (k + 1) * n)) for k in range(world_size // n)]
    return [shape.ranks]


def run(spec: CommSpec, *, device: torch.device) -> list[dict]:
    """Measure every (group, collective, size) point; rank 0 returns the curves."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    # Every rank creates every group, in the same order (torch.distributed.new_group's contract).
    groups = []
    for shape in spec.groups:
        mine = None
        for ranks in copies(shape, world_size):
            group = dist.new_group(list(ranks))
            if rank in ranks:
                mine = (ranks, group)
        groups.append(mine)
    points = [(shape, c, s) for shape in spec.groups for c in spec.collectives
              if c != "p2p" or len(shape.ranks) == 2 for s in spec.sizes_bytes]
    curves: list[dict] = []
    done = 0
    for shape, mine in zip(spec.groups, groups):
        for collective in spec.collectives:
            if collective == "p2p" and len(shape.ranks) != 2:
                continue
            curve = {"group": shape.name, "link": shape.link, "ranks": list(shape.ranks), "collective": collective,
                     "group_size": len(shape.ranks), "copies": len(copies(shape, world_size)),
                     "sizes_bytes": [], "median_s": [], "spread_s": [], "repeats": []}
            for size in spec.sizes_bytes:
                nbytes = _round_size(size, len(shape.ranks))
                op = lambda: None  # noqa: E731 - a rank outside every measured group keeps step
                if mine is not None:
                    ranks, group = mine
                    op = _make_op(collective, nbytes, ranks=ranks, group=group, device=device)
                times, calls = measure_point(op, group=None, device=device, budget_s=spec.budget_s_per_point,
                                      max_repeats=spec.max_repeats)
                curve["sizes_bytes"].append(nbytes)
                curve["median_s"].append(statistics.median(times))
                curve["spread_s"].append(_quantile(times, 0.9) - _quantile(times, 0.1))
                curve["repeats"].append(calls)
                done += 1
                if rank == 0:
                    emit_event("progress", done=done, total=len(points), label=f"{shape.name} {collective} {size}")
            if rank == 0:
                curves.append(curve)
    return curves


def run_task(spec_dict: dict) -> dict | None:
    """The worker task (runners.launch.worker_main)."""
    from specs.jsonio import dataclass_from_dict

    from runners.launch import pick_device

    spec = dataclass_from_dict(CommSpec, spec_dict, what="collective benchmark spec")
    # More ranks than GPUs share them over gloo (pick_device): LOCAL_RANK alone is no device ordinal.
    device, backend = pick_device()
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=spec.timeout_s))
    if os.environ.get("PLANNER_PROFILE_FAIL_RANK") == os.environ.get("RANK", "0"):
        # Test hook: lets the integration test check that a failed rank is reported by name.
        raise RuntimeError("injected failure (PLANNER_PROFILE_FAIL_RANK)")
    curves = run(spec, device=device)
    rank, result = dist.get_rank(), {"world_size": dist.get_world_size(), "backend": dist.get_backend(), "curves": curves}
    dist.destroy_process_group()
    return result if rank == 0 else None


if __name__ == "__main__":
    from runners.launch import exit_worker, worker_main

    exit_worker(worker_main(run_task))
