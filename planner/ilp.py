"""Integer programs for layer placement and per-layer recomputation (PuLP with its bundled CBC).

    from planner.ilp import StageCosts, balance_stages
    layout = balance_stages(StageCosts(...))   # -> stage_layers and recompute_layers for a Plan

Three programs, each exact for its inputs and tested against brute force:

- `partition_layers`: (a) split heterogeneous layers into contiguous pipeline chunks, minimising the
  slowest pipeline rank (the steady-state bottleneck of 1F1B: every micro-batch passes every rank, so
  the step is paced by the slowest one; Narayanan et al. SC21 sec. 2.2) under each rank's memory cap.
- `choose_recompute`: (b) pick none/selective/full per layer of one stage to minimise its time under a
  memory cap (a multiple-choice knapsack; Korthikanti et al. 2022 give the per-policy costs).
- `balance_stages`: (a) and (b) together for identical layers (what a transformer is), with integer
  layer counts per chunk and policy; this is what the search calls for its best candidates.

Times are in seconds of forward+backward(+recompute) per micro-batch; bytes are per device. Each
chunk c lives on pipeline rank c % pp (Megatron's interleaved placement), and `in_flight[c]` is how
many micro-batches' activations chunk c holds at its peak under the schedule.
"""

from __future__ import annotations

import functools
import os
import sys
from dataclasses import dataclass

from specs.errors import PlannerError

POLICIES = ("none", "selective", "full")


def _solve(problem, *, time_limit_s: float | None = None) -> None:
    """Solve quietly with HiGHS in this process (highspy), or PuLP's bundled CBC where highspy is
    missing; raise PlannerError unless a solution was found.

    These programs are small (tens of integers): CBC solves each in milliseconds but is a separate
    process, whose start-up (~0.2 s) was most of a 1024-GPU search's time; HiGHS through its Python
    binding has none. Without a time limit the optimum is proven. With one (the search's use: min-max
    programs over many near-symmetric chunks can take minutes to close the last gap) the best solution
    found in time is accepted; the caller re-prices it with the full cost model anyway.
    """
    import pulp

    gap = 1e-5 if time_limit_s else None
    solver = pulp.HiGHS(msg=False, timeLimit=time_limit_s, gapRel=gap)
    if solver.available():
        _silence_highs_banner()
    else:
        solver = pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit_s, gapRel=gap)
    problem.solve(solver)
    if problem.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        status = pulp.LpStatus[problem.status].lower()
        raise PlannerError(f"ILP {problem.name}: {status} (no placement fits the memory cap in time)")


@functools.cache
def _silence_highs_banner() -> None:
    """HiGHS writes its copyright banner to the process's stdout (C++, not Python's sys.stdout) the first
    time a solver is made, whatever its options; that would corrupt `--format json`. Make that first
    one here with file descriptor 1 pointed at /dev/null."""
    import highspy

    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 1)
            highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def _value(var) -> float:
    return float(var.value() or 0.0)


# --- (a) contiguous partition of heterogeneous layers -------------------------------------------------
@dataclass(frozen=True)
class Partition:
    chunk_layers: tuple[int, ...]  # layers per chunk, in chunk order
    bottleneck_time_s: float  # the slowest pipeline rank's time per micro-batch


def partition_layers(*, layer_time_s: list[float], layer_state_bytes: list[float],
                     layer_activation_bytes: list[float], pp: int, num_chunks: int, in_flight: list[int],
                     memory_cap_bytes: float, first_extra_time_s: float = 0.0, last_extra_time_s: float = 0.0,
                     first_extra_bytes: float = 0.0, last_extra_bytes: float = 0.0) -> Partition:
    """Assign layers 0..L-1 to `num_chunks` contiguous chunks minimising the slowest rank's time.

    Formulation: prefix indicators below[i][c] = 1 when layer i sits in chunk c or an earlier one;
    layer i is in chunk c exactly when below[i][c] - below[i][c-1] = 1.
    """
    import pulp

    num_layers = len(layer_time_s)
    if num_chunks > num_layers:
        raise PlannerError(f"{num_chunks} chunks for {num_layers} layers: a chunk would be empty")
    time_scale = max(max(layer_time_s), first_extra_time_s, last_extra_time_s, 1e-30)
    mem_scale = max(memory_cap_bytes, 1.0)
    prob = pulp.LpProblem("partition_layers", pulp.LpMinimize)
    below = [[pulp.LpVariable(f"below_{i}_{c}", cat="Binary") for c in range(num_chunks)] for i in range(num_layers)]
    bottleneck = pulp.LpVariable("bottleneck", lowBound=0)
    prob += bottleneck

    def member(i: int, c: int):
        return below[i][c] - (below[i][c - 1] if c > 0 else 0)

    for i in range(num_layers):
        # Every layer is in some chunk: "in the last chunk or earlier" holds for all layers.
        prob += below[i][num_chunks - 1] == 1, f"placed_{i}"
        for c in range(num_chunks - 1):
            # A layer below chunk c is also below chunk c+1; this makes member() a 0/1 indicator.
            prob += below[i][c] <= below[i][c + 1], f"nested_{i}_{c}"
        if i > 0:
            for c in range(num_chunks):
                # Layer order follows chunk order (contiguity): if layer i is at or below chunk c,
                # so is layer i-1, otherwise a chunk would hold non-adjacent layers.
                prob += below[i][c] <= below[i - 1][c], f"contiguous_{i}_{c}"
    for c in range(num_chunks):
        # No empty chunk: Plan.stage_layers needs at least one layer in every pipeline stage.
        prob += pulp.lpSum(member(i, c) for i in range(num_layers)) >= 1, f"nonempty_{c}"
    for rank in range(pp):
        chunks = range(rank, num_chunks, pp)
        extra_t = (first_extra_time_s if 0 in chunks else 0.0) + (last_extra_time_s if num_chunks - 1 in chunks else 0.0)
        extra_b = (first_extra_bytes if 0 in chunks else 0.0) + (last_extra_bytes if num_chunks - 1 in chunks else 0.0)
        # The bottleneck is at least every rank's time per micro-batch, so minimising it minimises
        # the slowest rank (the 1F1B steady state runs at that rank's pace).
        prob += (pulp.lpSum(layer_time_s[i] / time_scale * member(i, c) for c in chunks for i in range(num_layers))
                 + extra_t / time_scale <= bottleneck), f"time_rank_{rank}"
        # The rank's weights/grads/optimizer states plus the activations of every micro-batch its
        # chunks hold in flight must fit its memory cap, or the plan would run out of memory.
        prob += (pulp.lpSum((layer_state_bytes[i] + in_flight[c] * layer_activation_bytes[i]) / mem_scale * member(i, c)
                            for c in chunks for i in range(num_layers))
                 + extra_b / mem_scale <= memory_cap_bytes / mem_scale), f"memory_rank_{rank}"
    _solve(prob)
    counts = [sum(round(_value(below[i][c]) - (_value(below[i][c - 1]) if c else 0.0)) for i in range(num_layers))
              for c in range(num_chunks)]
    return Partition(chunk_layers=tuple(counts),
                     bottleneck_time_s=_bottleneck(counts, layer_time_s, pp, first_extra_time_s, last_extra_time_s))


def _bottleneck(counts: list[int], layer_time_s: list[float], pp: int, first_t: float, last_t: float) -> float:
    """Slowest rank's time per micro-batch for a contiguous split `counts` (shared with brute force)."""
    rank_time = [0.0] * pp
    start = 0
    for c, n in enumerate(counts):
        rank_time[c % pp] += sum(layer_time_s[start:start + n])
        start += n
    rank_time[0] += first_t
    rank_time[(len(counts) - 1) % pp] += last_t
    return max(rank_time)


# --- (b) per-layer recomputation for one stage -------------------------------------------------------
@dataclass(frozen=True)
class RecomputeChoice:
    policies: tuple[str, ...]
    time_s: float
    memory_bytes: float


def choose_recompute(*, time_s: list[dict[str, float]], memory_bytes: list[dict[str, float]],
                     memory_cap_bytes: float, policies: tuple[str, ...] = POLICIES) -> RecomputeChoice:
    """One policy per layer minimising the total time, with the total memory under the cap.

    `time_s[i][p]` and `memory_bytes[i][p]` are layer i's time and bytes under policy p (memory already
    multiplied by the micro-batches in flight).
    """
    import pulp

    num_layers = len(time_s)
    time_scale = max(max(t.values()) for t in time_s) or 1.0
    mem_scale = max(memory_cap_bytes, 1.0)
    prob = pulp.LpProblem("choose_recompute", pulp.LpMinimize)
    pick = [{p: pulp.LpVariable(f"pick_{i}_{p}", cat="Binary") for p in policies} for i in range(num_layers)]
    prob += pulp.lpSum(time_s[i][p] / time_scale * pick[i][p] for i in range(num_layers) for p in policies)
    for i in range(num_layers):
        # Exactly one policy per layer: a layer either keeps its activations, keeps some, or keeps none.
        prob += pulp.lpSum(pick[i].values()) == 1, f"one_policy_{i}"
    # The stage's activation and state memory under the chosen policies must fit the device.
    prob += (pulp.lpSum(memory_bytes[i][p] / mem_scale * pick[i][p] for i in range(num_layers) for p in policies)
             <= memory_cap_bytes / mem_scale), "memory"
    _solve(prob)
    chosen = tuple(max(policies, key=lambda p: _value(pick[i][p])) for i in range(num_layers))
    return RecomputeChoice(policies=chosen, time_s=sum(time_s[i][p] for i, p in enumerate(chosen)),
                           memory_bytes=sum(memory_bytes[i][p] for i, p in enumerate(chosen)))


# --- (a) + (b) for identical layers: what the search uses ---------------------------------------------
@dataclass(frozen=True)
class StageCosts:
    """Per-layer costs of one plan's layers (all identical) and the pipeline's shape."""

    num_layers: int
    pp: int
    num_chunks: int
    time_s: dict[str, float]  # per policy: fwd+bwd(+recompute) of one layer, one micro-batch
    activation_bytes: dict[str, float]  # per policy: bytes one layer keeps per micro-batch in flight
    state_bytes: float  # weights, gradients, optimizer states of one layer on one device
    in_flight: tuple[int, ...]  # per chunk: micro-batches whose activations it holds at its peak
    memory_cap_bytes: float  # per device, for the layers and the embedding/head extras
    first_extra_time_s: float = 0.0
    last_extra_time_s: float = 0.0
    first_extra_bytes: float = 0.0
    last_extra_bytes: float = 0.0


@dataclass(frozen=True)
class StageLayout:
    stage_layers: tuple[int, ...]
    recompute_layers: tuple[str, ...]  # one policy per layer, in layer order
    bottleneck_time_s: float


def layout_bottleneck_s(costs: StageCosts, counts: list[dict[str, int]]) -> float:
    """Slowest rank's time per micro-batch for per-chunk policy counts."""
    rank_time = [0.0] * costs.pp
    for c, per_policy in enumerate(counts):
        rank_time[c % costs.pp] += sum(n * costs.time_s[p] for p, n in per_policy.items())
    rank_time[0] += costs.first_extra_time_s
    rank_time[(costs.num_chunks - 1) % costs.pp] += costs.last_extra_time_s
    return max(rank_time)


def layout_memory_bytes(costs: StageCosts, counts: list[dict[str, int]]) -> list[float]:
    """Each rank's bytes for per-chunk policy counts (the quantity the memory constraints cap)."""
    rank_bytes = [0.0] * costs.pp
    for c, per_policy in enumerate(counts):
        rank_bytes[c % costs.pp] += sum(n * (costs.state_bytes + costs.in_flight[c] * costs.activation_bytes[p])
                                        for p, n in per_policy.items())
    rank_bytes[0] += costs.first_extra_bytes
    rank_bytes[(costs.num_chunks - 1) % costs.pp] += costs.last_extra_bytes
    return rank_bytes


def balance_stages(costs: StageCosts, *, policies: tuple[str, ...] = POLICIES,
                   time_limit_s: float | None = None) -> StageLayout:
    """Layers per chunk and recomputation per layer minimising the slowest rank under the memory cap.

    Integer count[c][p] = layers of chunk c that use policy p. Since layers are identical, which
    layers inside a chunk recompute does not matter; the cheapest-memory policies go last in a chunk.
    A small second objective (total time of all ranks) stops non-bottleneck ranks from recomputing
    for nothing.
    """
    import pulp

    c_range, pp = range(costs.num_chunks), costs.pp
    if costs.num_chunks > costs.num_layers:
        raise PlannerError(f"{costs.num_chunks} chunks for {costs.num_layers} layers: a chunk would be empty")
    time_scale = max(max(costs.time_s[p] for p in policies), 1e-30)
    mem_scale = max(costs.memory_cap_bytes, 1.0)
    prob = pulp.LpProblem("balance_stages", pulp.LpMinimize)
    count = [{p: pulp.LpVariable(f"count_{c}_{p}", lowBound=0, upBound=costs.num_layers, cat="Integer")
              for p in policies} for c in c_range]
    bottleneck = pulp.LpVariable("bottleneck", lowBound=0)
    total = pulp.lpSum(costs.time_s[p] / time_scale * count[c][p] for c in c_range for p in policies)
    prob += bottleneck + 1e-4 / costs.num_layers * total
    # Every layer is placed exactly once, under exactly one policy.
    prob += pulp.lpSum(count[c][p] for c in c_range for p in policies) == costs.num_layers, "all_layers"
    for c in c_range:
        # No empty chunk: Plan.stage_layers needs at least one layer in every pipeline stage.
        prob += pulp.lpSum(count[c].values()) >= 1, f"nonempty_{c}"
    for rank in range(pp):
        chunks = range(rank, costs.num_chunks, pp)
        first, last = 0 in chunks, costs.num_chunks - 1 in chunks
        extra_t = costs.first_extra_time_s * first + costs.last_extra_time_s * last
        extra_b = costs.first_extra_bytes * first + costs.last_extra_bytes * last
        # The bottleneck is at least every rank's time per micro-batch (its chunks' layers plus the
        # embedding/head it holds), so minimising it minimises the slowest rank, which paces 1F1B.
        prob += (pulp.lpSum(costs.time_s[p] / time_scale * count[c][p] for c in chunks for p in policies)
                 + extra_t / time_scale <= bottleneck), f"time_rank_{rank}"
        # The rank's layer states plus the activations its chunks keep for every micro-batch in
        # flight (fewer under recomputation), plus embedding/head, must fit the per-device cap.
        prob += (pulp.lpSum((costs.state_bytes + costs.in_flight[c] * costs.activation_bytes[p]) / mem_scale
                            * count[c][p] for c in chunks for p in policies)
                 + extra_b / mem_scale <= costs.memory_cap_bytes / mem_scale), f"memory_rank_{rank}"
    _solve(prob, time_limit_s=time_limit_s)
    counts = [{p: round(_value(count[c][p])) for p in policies} for c in c_range]
    order = sorted(policies, key=lambda p: costs.activation_bytes[p], reverse=True)
    recompute = tuple(p for c in c_range for p in order for _ in range(counts[c][p]))
    return StageLayout(stage_layers=tuple(sum(cnt.values()) for cnt in counts), recompute_layers=recompute,
                       bottleneck_time_s=layout_bottleneck_s(costs, counts))


# --- (c) MAZ3: where each layer keeps its forward-gathered parameters ---------------------------------
CACHE_TIERS = ("none", "device", "host", "secondary")


@dataclass(frozen=True)
class CacheCosts:
    """Per-layer MAZ3 prices of one plan (Liu et al., ICNP 2025), per micro-batch and per device.

    fetch_s[i][tier]: what layer i's backward waits on to get its parameters back (a second all-gather
    for "none", nothing for "device", a host-to-device copy for "host", an intra-node all-gather of
    secondary shards for "secondary"). forward_extra_s[i][tier]: forward-side work the tier adds (the
    device-to-host copy of "host"). device_bytes / host_bytes[i][tier]: the kept copy's bytes.
    layer_chunk[i]: the chunk of layer i (chunk c on pipeline rank c % pp). Per chunk, the backward
    (forward) window is the compute its other fetches (copies) hide behind, after what the chunk's
    communication stream already carries; the backward fetch of a chunk's last layer, which runs
    first in backward, is exposed whole (nothing computes before it). Caps are per pipeline rank.
    """

    fetch_s: tuple[dict[str, float], ...]
    forward_extra_s: tuple[dict[str, float], ...]
    device_bytes: tuple[dict[str, float], ...]
    host_bytes: tuple[dict[str, float], ...]
    layer_chunk: tuple[int, ...]
    pp: int
    backward_window_s: tuple[float, ...]
    forward_window_s: tuple[float, ...]
    num_micro_batches: int
    device_cap_bytes: tuple[float, ...]
    host_cap_bytes: tuple[float, ...]


@dataclass(frozen=True)
class CacheChoice:
    tiers: tuple[str, ...]  # one per layer, in layer order
    exposed_comm_s: float  # per step, by `cache_exposed_s`


def _chunk_layers(costs: CacheCosts) -> dict[int, list[int]]:
    chunks: dict[int, list[int]] = {}
    for i, c in enumerate(costs.layer_chunk):
        chunks.setdefault(c, []).append(i)
    return chunks


def cache_exposed_s(costs: CacheCosts, tiers: tuple[str, ...]) -> float:
    """Exposed communication per step of a tier assignment (the ILP's objective, for brute force)."""
    total = 0.0
    for c, layers in _chunk_layers(costs).items():
        last = layers[-1]
        rest = sum(costs.fetch_s[i][tiers[i]] for i in layers if i != last)
        copies = sum(costs.forward_extra_s[i][tiers[i]] for i in layers)
        total += (costs.fetch_s[last][tiers[last]] + max(0.0, rest - costs.backward_window_s[c])
                  + max(0.0, copies - costs.forward_window_s[c]))
    return costs.num_micro_batches * total


def cache_fits(costs: CacheCosts, tiers: tuple[str, ...]) -> bool:
    """Whether every rank's kept copies fit its device and host caps (the ILP's constraints)."""
    for rank in range(costs.pp):
        mine = [i for i, c in enumerate(costs.layer_chunk) if c % costs.pp == rank]
        if sum(costs.device_bytes[i][tiers[i]] for i in mine) > costs.device_cap_bytes[rank]:
            return False
        if sum(costs.host_bytes[i][tiers[i]] for i in mine) > costs.host_cap_bytes[rank]:
            return False
    return True


def choose_param_cache(costs: CacheCosts, *, tiers: tuple[str, ...] = CACHE_TIERS,
                       time_limit_s: float | None = None) -> CacheChoice:
    """One MAZ3 tier per layer minimising the step's exposed communication under the memory caps.

    Binary pick[i][t] = layer i keeps its parameters in tier t. Per chunk, continuous exposed_b / exposed_f
    carry max(0, fetches - window) (the linearised overlap of cache_exposed_s). A tiny second objective
    (bytes kept, relative to the caps) picks the leanest of equally fast assignments, so no layer keeps
    a copy that hides nothing.
    """
    import pulp

    num_layers = len(costs.layer_chunk)
    chunks = _chunk_layers(costs)
    time_scale = max([max(f.values()) for f in costs.fetch_s] + [max(f.values()) for f in costs.forward_extra_s]
                     + [1e-30])
    prob = pulp.LpProblem("choose_param_cache", pulp.LpMinimize)
    pick = [{t: pulp.LpVariable(f"pick_{i}_{t}", cat="Binary") for t in tiers} for i in range(num_layers)]
    exposed_b = {c: pulp.LpVariable(f"exposed_b_{c}", lowBound=0) for c in chunks}
    exposed_f = {c: pulp.LpVariable(f"exposed_f_{c}", lowBound=0) for c in chunks}
    first_fetch = pulp.lpSum(costs.fetch_s[layers[-1]][t] / time_scale * pick[layers[-1]][t]
                             for layers in chunks.values() for t in tiers)
    cap_scale = max(list(costs.device_cap_bytes) + list(costs.host_cap_bytes) + [1.0])
    kept = pulp.lpSum((costs.device_bytes[i][t] + costs.host_bytes[i][t]) / cap_scale * pick[i][t]
                      for i in range(num_layers) for t in tiers)
    prob += first_fetch + pulp.lpSum(exposed_b.values()) + pulp.lpSum(exposed_f.values()) + 1e-6 / num_layers * kept
    for i in range(num_layers):
        # Each layer keeps its gathered parameters in exactly one place (or drops them: "none").
        prob += pulp.lpSum(pick[i].values()) == 1, f"one_tier_{i}"
    for c, layers in chunks.items():
        # Backward: the fetches of the chunk's other layers beyond its backward compute window are
        # exposed (exposed_b >= 0 from its bound, so a fully hidden chunk costs nothing).
        prob += (pulp.lpSum(costs.fetch_s[i][t] / time_scale * pick[i][t] for i in layers[:-1] for t in tiers)
                 - costs.backward_window_s[c] / time_scale <= exposed_b[c]), f"backward_window_{c}"
        # Forward: host-tier device-to-host copies beyond the forward compute window are exposed.
        prob += (pulp.lpSum(costs.forward_extra_s[i][t] / time_scale * pick[i][t] for i in layers for t in tiers)
                 - costs.forward_window_s[c] / time_scale <= exposed_f[c]), f"forward_window_{c}"
    for rank in range(costs.pp):
        mine = [i for i, c in enumerate(costs.layer_chunk) if c % costs.pp == rank]
        # The rank's device-tier copies and secondary shards must fit the device memory the plan
        # leaves free, or the plan runs out of device memory.
        prob += (pulp.lpSum(costs.device_bytes[i][t] / cap_scale * pick[i][t] for i in mine for t in tiers)
                 <= costs.device_cap_bytes[rank] / cap_scale), f"device_memory_{rank}"
        # The rank's host-tier copies must fit the host memory each device has (pinned buffers).
        prob += (pulp.lpSum(costs.host_bytes[i][t] / cap_scale * pick[i][t] for i in mine for t in tiers)
                 <= costs.host_cap_bytes[rank] / cap_scale), f"host_memory_{rank}"
    _solve(prob, time_limit_s=time_limit_s)
    chosen = tuple(max(tiers, key=lambda t: _value(pick[i][t])) for i in range(num_layers))
    return CacheChoice(tiers=chosen, exposed_comm_s=cache_exposed_s(costs, chosen))
