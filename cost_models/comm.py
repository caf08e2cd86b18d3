"""Communication time of collectives, and the per-step communication volume of a plan.

Collective of B bytes (the full buffer: the all-reduce input, the all-gather output, the reduce-scatter
input) over n ranks, ring algorithm (Thakur et al. 2005; NCCL):

    all_reduce      2 (n-1)/n * B / bw + 2 (n-1) * latency
    all_gather      (n-1)/n * B / bw + (n-1) * latency        (reduce_scatter, all_to_all the same)
    broadcast       B / bw + (n-1) * latency                   (pipelined ring)
    p2p             B / bw + latency
    ring_step       B / bw + latency                           (each rank sends B to the next, receives B)

where bw is the per-device unidirectional bandwidth of the link class the group spans. A group that
spans nodes is priced hierarchically, the way NCCL's rings use one NIC per GPU: a reduce-scatter (or
all-gather) inside each node over its r members, then the collective across the k nodes on the
1/r-size shards, all r NICs of a node working in parallel; so r members per node multiply the effective
inter-node bandwidth by r, and a group with one member per node (e.g. DP across TP=8 nodes) runs at one
NIC's bandwidth.

When the profile has a measured `CollectiveFit` for the collective and link class, it replaces the
datasheet link (the fit measured at group size n, else the nearest measured one with its latency scaled
by the ring's steps): time = latency_s + factor(n) * B / bus_bandwidth, with factor 2(n-1)/n for all-reduce,
(n-1)/n for all-gather, reduce-scatter and all-to-all, 1 for broadcast and p2p (NCCL-tests'
bus-bandwidth convention), over the whole group with no hierarchical split (the fit was measured on the
real topology).
"""

from __future__ import annotations

import math

from specs.cluster import Cluster
from specs.hardware import Hardware

_BUS_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "p2p": lambda n: 1.0,
    "ring_step": lambda n: 1.0,
}
_LATENCY_STEPS = {
    "all_reduce": lambda n: 2 * (n - 1),
    "all_gather": lambda n: n - 1,
    "reduce_scatter": lambda n: n - 1,
    "all_to_all": lambda n: n - 1,
    "broadcast": lambda n: n - 1,
    "p2p": lambda n: 1,
    "ring_step": lambda n: 1,
}


def _fit(hw: Hardware, collective: str, link: str, group_size: int | None = None):
    """The profile's fit for this collective and link class: the one measured at `group_size`, else the
    one at the nearest measured group size (in log2; the larger on a tie); None if there is none."""
    fits = [f for f in hw.collectives if f.collective == collective and f.link == link]
    if not fits or group_size is None:
        return fits[0] if fits else None
    return min(fits, key=lambda f: (abs(math.log2(f.group_size) - math.log2(group_size)), -f.group_size))


def flat_collective_time_s(hw: Hardware, *, collective: str, size_bytes: float, group_size: int, link: str) -> float:
    """Time of a collective over `group_size` ranks that all talk over one link class."""
    if collective not in _BUS_FACTOR:
        raise ValueError(f"unknown collective {collective!r}")
    n = 2 if collective == "p2p" else group_size
    if n <= 1 or size_bytes <= 0:
        return 0.0
    scale = hw.calibration.get("comm_time_scale", 1.0)
    fit = _fit(hw, collective, link, n)
    if fit is not None:
        # A fit measured at another group size: its latency scales with the ring's steps; its bus
        # bandwidth already is per-device (NCCL-tests' convention), so it carries over.
        steps = _LATENCY_STEPS[collective]
        latency_s = fit.latency_s * steps(n) / steps(2 if collective == "p2p" else fit.group_size)
        return scale * (latency_s + _BUS_FACTOR[collective](n) * size_bytes / fit.bandwidth_bytes_per_s)
    spec = hw.link(link)
    return scale * (_LATENCY_STEPS[collective](n) * spec.latency_s
                    + _BUS_FACTOR[collective](n) * size_bytes / spec.bandwidth_bytes_per_s)


def ring_step_time_s(hw: Hardware, *, size_bytes: float, group_size: int, link: str) -> float:
    """One step of a ring of `group_size` ranks in which each sends `size_bytes` to the next and receives as
    much from the previous, at once (context parallelism's K/V ring). Priced from the profile's ring-step
    curve where it has one for `link`; else from its one-way point-to-point curve or the datasheet link, a
    full-duplex link carrying both directions in the time of one. On gloo over CPU cores the two directions
    are not free: a 4-process ring step measured 2.8x the one-way send's time after a barrier."""
    if group_size <= 1 or size_bytes <= 0:
        return 0.0
    if _fit(hw, "ring_step", link) is not None:
        return flat_collective_time_s(hw, collective="ring_step", size_bytes=size_bytes, group_size=group_size,
                                      link=link)
    return flat_collective_time_s(hw, collective="p2p", size_bytes=size_bytes, group_size=2, link=link)


def collective_time_s(cluster: Cluster, *, collective: str, size_bytes: float, group_size: int,
                      stride: int) -> float:
    """Time of a collective of `size_bytes` over a group of `group_size` ranks spaced `stride` apart."""
    hw = cluster.hardware
    if collective == "p2p":
        link = cluster.group_link(size=2, stride=stride)
        return flat_collective_time_s(hw, collective="p2p", size_bytes=size_bytes, group_size=2, link=link)
    if group_size <= 1 or size_bytes <= 0:
        return 0.0
    link = cluster.group_link(size=group_size, stride=stride)
    if link == "intra_node" or _fit(hw, collective, "inter_node") is not None:
        return flat_collective_time_s(hw, collective=collective, size_bytes=size_bytes, group_size=group_size,
                                      link=link)
    per_node = cluster.ranks_per_node_in_group(size=group_size, stride=stride)
    num_nodes = max(1, group_size // per_node)
    if collective in ("broadcast", "all_to_all"):
        # No shard-then-cross structure to exploit: every byte crosses at one NIC's bandwidth.
        return flat_collective_time_s(hw, collective=collective, size_bytes=size_bytes, group_size=group_size,
                                      link="inter_node")
    inner = "reduce_scatter" if collective in ("all_reduce", "reduce_scatter") else "all_gather"
    time_s = flat_collective_time_s(hw, collective=inner, size_bytes=size_bytes, group_size=per_node,
                                    link="intra_node")
    time_s += flat_collective_time_s(hw, collective=collective, size_bytes=size_bytes / per_node,
                                     group_size=num_nodes, link="inter_node")
    if collective == "all_reduce":
        time_s += flat_collective_time_s(hw, collective="all_gather", size_bytes=size_bytes, group_size=per_node,
                                         link="intra_node")
    else:
        time_s += ring_extra_intra_steps(per_node=per_node, num_nodes=num_nodes) * \
            hw.intra_node.latency_s * hw.calibration.get("comm_time_scale", 1.0)
    return time_s


def ring_extra_intra_steps(*, per_node: int, num_nodes: int) -> int:
    """Intra-node latency steps a ring all-gather or reduce-scatter over `num_nodes` x `per_node` ranks
    takes beyond the per_node - 1 its in-node phase is priced with: (num_nodes - 1) x (per_node - 1).

    NCCL runs these two collectives on one ring through every rank (the only algorithm it has for them
    across nodes with several ranks per node, up to PAT for one rank per node): n - 1 steps, of which
    k - 1 cross a node boundary and n - k are NVLink hops, each a latency of its own (NCCL's tuning model,
    src/graph/tuning.cc: `(nsteps - nInterSteps) * intraLat + nInterSteps * interLat`, with intraLat
    floored at three net overheads on inter-node rings under the Simple protocol). The hierarchical
    pricing above charges r - 1 intra and k - 1 inter steps, so an n-rank ring's latency grew with the
    node count only through its k - 1 crossings. The all-reduce keeps the hierarchical count: NCCL can
    pick its tree there, whose latency grows with log2 of the node count."""
    if num_nodes <= 1 or per_node <= 1:
        return 0
    return (num_nodes - 1) * (per_node - 1)


def nearest_group_size(sizes, size: int) -> int:
    """Of the measured group `sizes`, the one nearest `size` in ratio, the smaller on a tie (a probe's keys by
    group size: the sync waits here, the context probe's extras in cost_models/context.py)."""
    return min(sizes, key=lambda c: (abs(math.log(c / size)), c))


# The sync-wait probe's measurements (runners/probe.measure_sync_wait, CPU profiles only), per group size c and
# segment length w (microseconds): `sync_wait_s_{c}_{w}` calibration keys.
SYNC_WAIT_PREFIX = "sync_wait_s_"


def sync_wait_s(calibration: dict[str, float], *, group_size: int, segment_s: float) -> float:
    """Seconds a blocking collective over `group_size` ranks waits, beyond its own time, for the ranks that reach it
    last after `segment_s` seconds of compute on every rank since the group last met: each rank's compute runs a
    little longer or shorter (timer interrupts, cache misses, and where more processes than cores share a host,
    the scheduler's time slices), and the group starts when its slowest rank arrives, so the wait grows with the
    segment. Measured by the sync-wait probe at a few segment lengths (SYNC_WAIT_PREFIX keys; the measured group
    size nearest in ratio, the smaller on a tie), counted from its shortest segment: what a rank waits after a
    segment that short is already in the per-call prices fitted or probed at short segments (`planner tune`'s
    collective_overhead_s, the context probe's per-message extras), so this is what it waits beyond that after a
    longer one. Piecewise linear through the measured points, 0 up to the shortest, flat beyond the longest, times
    the calibration's sync_wait_scale (`planner tune` fits it, 1 by default); 0 where nothing was measured (GPU
    profiles, presets, older profiles). Never falling with a longer segment: the ranks' drift over a longer
    segment holds the shorter one's, so a point below an earlier one is the probe's noise (one fresh 4-rank
    profile read 1.7 ms after 8 ms and 0 after 32 ms) and the earlier one's wait holds."""
    if group_size <= 1 or segment_s <= 0.0:
        return 0.0
    curves: dict[int, list[tuple[float, float]]] = {}
    for key, value in calibration.items():
        size, _, micros = key[len(SYNC_WAIT_PREFIX):].partition("_")
        if key.startswith(SYNC_WAIT_PREFIX) and size.isdigit() and micros.isdigit() and int(size) > 0:
            curves.setdefault(int(size), []).append((int(micros) * 1e-6, max(0.0, value)))
    if not curves:
        return 0.0
    curve = sorted(curves[nearest_group_size(curves, group_size)])
    scale = calibration.get("sync_wait_scale", 1.0)
    base, held, rising = curve[0][1], 0.0, []
    for w, v in curve:
        held = max(held, v - base)
        rising.append((w, scale * held))
    curve = rising
    if segment_s <= curve[0][0]:
        return 0.0
    for (w0, v0), (w1, v1) in zip(curve, curve[1:]):
        if segment_s <= w1:
            return v0 + (v1 - v0) * (segment_s - w0) / (w1 - w0)
    return curve[-1][1]


def has_sync_waits(calibration: dict[str, float]) -> bool:
    """Whether a calibration holds the sync-wait probe's keys (a CPU profile of version 7 or later)."""
    return any(key.startswith(SYNC_WAIT_PREFIX) for key in calibration)


def sync_waits_s(calibration: dict[str, float], *, group_size: int, syncs: int, forward_s: float,
                 backward_s: float) -> tuple[float, float]:
    """(forward, backward) seconds of `sync_wait_s` for a layer that meets its group `syncs` times in its
    forward and as often in its backward, each pass's compute split evenly between them."""
    if syncs <= 0:
        return 0.0, 0.0
    return tuple(syncs * sync_wait_s(calibration, group_size=group_size, segment_s=s / syncs)
                 for s in (forward_s, backward_s))
