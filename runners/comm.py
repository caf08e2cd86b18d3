"""Collectives with accounting: every engine collective goes through here so that bytes per collective
type and per link class (intra-node, inter-node) and the time spent waiting are counted.

Byte convention (what one rank puts on the wire under a ring algorithm, the volume the cost model
prices): all-gather and reduce-scatter (n - 1)/n x the unsharded size, all-reduce 2(n - 1)/n x size,
broadcast and point-to-point x size, all-to-all (n - 1)/n x size (the part that leaves the rank). The volume is split between link classes by the ring's edges: of
the n edges of a ring over the group's ranks in order, those that join ranks on different (emulated)
nodes carry inter-node traffic. "host_device" counts bytes copied between device and host memory (the
MAZ3 host tier, runners/sharding/), in either direction; they use no network link, so they are in
neither intra_node nor inter_node.

"inter_node_wire" is the inter-node volume as the backend really moves it, where that differs from the
ring: torch's gloo backend runs reduce_scatter_tensor as an all-reduce of the whole input, each rank then
keeping its chunk (ProcessGroupGloo::reduce_scatter_tensor_coalesced), so a reduce-scatter on gloo moves
2(n - 1)/n of the size, twice the ring's. It is what the veth counters of the emulated cluster measure
(benchmarks/wire_bytes.py, tests/integration/test_netns_cluster.py), up to the protocol headers.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "all_to_all", "p2p", "host_device")

# Newer torch names them *_single and deprecates the *_tensor / *_into_tensor spellings.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class CommCounters:
    bytes_by_kind: dict[str, int] = field(default_factory=lambda: {k: 0 for k in KINDS})
    intra_node_bytes: int = 0
    inter_node_bytes: int = 0
    inter_node_wire_bytes: int = 0
    wait_s: float = 0.0
    # MoE routing (runners/moe.py), not bytes: per MoE layer the (token, expert) assignments this rank
    # routed to each expert, and how many of them went to another EP rank.
    expert_rows: dict[int, list[int]] = field(default_factory=dict)
    moe_rows_off_rank: int = 0

    def reset(self) -> None:
        for k in self.bytes_by_kind:
            self.bytes_by_kind[k] = 0
        self.intra_node_bytes = self.inter_node_bytes = self.inter_node_wire_bytes = 0
        self.wait_s = 0.0
        self.expert_rows.clear()
        self.moe_rows_off_rank = 0

    def count_routing(self, layer: int, counts: list[int], *, off_rank: int) -> None:
        rows = self.expert_rows.setdefault(layer, [0] * len(counts))
        for e, c in enumerate(counts):
            rows[e] += c
        self.moe_rows_off_rank += off_rank

    def snapshot(self) -> dict:
        return {**self.bytes_by_kind, "intra_node": self.intra_node_bytes, "inter_node": self.inter_node_bytes,
                "inter_node_wire": self.inter_node_wire_bytes}


class Comm:
    """The collectives of one process, with counters; `ranks_per_node` groups global ranks into nodes.

    On a CUDA `device` the time blocked on communication has two parts: the CPU blocked in a wait (gloo)
    and the compute stream stalled behind a collective it was told to wait for (NCCL's `work.wait()`
    returns at once and makes the stream wait), measured with CUDA events around the wait and added up
    by `settle()` once the device has synchronised. gloo cannot send CUDA tensors point to point (it
    would read device memory as host memory), so those go through host copies."""

    def __init__(self, *, ranks_per_node: int, device: torch.device | None = None) -> None:
        self.ranks_per_node = max(1, ranks_per_node)
        self.counters = CommCounters()
        self._cross_fraction: dict[tuple[int, ...], float] = {}
        self.device = device
        self._stall_events: list[tuple[object, object]] = []

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def _inter_fraction(self, ranks: tuple[int, ...]) -> float:
        """Fraction of a ring's edges over `ranks` that cross nodes."""
        frac = self._cross_fraction.get(ranks)
        if frac is None:
            n = len(ranks)
            crossings = sum(self.node_of(ranks[i]) != self.node_of(ranks[(i + 1) % n]) for i in range(n))
            frac = crossings / n if n > 1 else 0.0
            self._cross_fraction[ranks] = frac
        return frac

    def _count(self, kind: str, volume_bytes: float, ranks: tuple[int, ...], *, wire_factor: int = 1) -> None:
        volume = int(volume_bytes)
        self.counters.bytes_by_kind[kind] += volume
        inter = int(volume * self._inter_fraction(ranks))
        self.counters.inter_node_bytes += inter
        self.counters.intra_node_bytes += volume - inter
        self.counters.inter_node_wire_bytes += wire_factor * inter

    @staticmethod
    def _group_ranks(group) -> tuple[int, ...]:
        return tuple(dist.get_process_group_ranks(group)) if group is not None else tuple(range(dist.get_world_size()))

    # The c10d calls underneath the data-parallel collectives; the layer probe's stand-in (runners/probe.py,
    # measure_sharding) replaces them with local copies to time the engine's own bookkeeping around them.
    @staticmethod
    def _c10d_all_reduce(tensor: torch.Tensor, *, op, group, async_op: bool):
        return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)

    @staticmethod
    def _c10d_all_gather(output: torch.Tensor, shard: torch.Tensor, *, group, async_op: bool):
        return all_gather_single(output, shard, group=group, async_op=async_op)

    @staticmethod
    def _c10d_reduce_scatter(output: torch.Tensor, full: torch.Tensor, *, group, async_op: bool):
        return reduce_scatter_single(output, full, group=group, async_op=async_op)

    # --- collectives ---------------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, group, *, async_op: bool = False, op=dist.ReduceOp.SUM):
        ranks = self._group_ranks(group)
        n = len(ranks)
        if n == 1:
            return None
        self._count("all_reduce", 2 * (n - 1) / n * tensor.numel() * tensor.element_size(), ranks)
        return self._c10d_all_reduce(tensor, op=op, group=group, async_op=async_op)

    def all_gather(self, output: torch.Tensor, shard: torch.Tensor, group, *, async_op: bool = False):
        """Gather `shard` from every group rank into `output` (group-rank order)."""
        ranks = self._group_ranks(group)
        n = len(ranks)
        if n == 1:
            output.copy_(shard)
            return None
        self._count("all_gather", (n - 1) / n * output.numel() * output.element_size(), ranks)
        return self._c10d_all_gather(output, shard, group=group, async_op=async_op)

    def reduce_scatter(self, output: torch.Tensor, full: torch.Tensor, group, *, async_op: bool = False):
        """Sum `full` over the group and leave chunk i (group-rank order) in group rank i's `output`."""
        ranks = self._group_ranks(group)
        n = len(ranks)
        if n == 1:
            output.copy_(full)
            return None
        gloo = dist.get_backend(group) == "gloo"  # an all-reduce underneath (module docstring)
        self._count("reduce_scatter", (n - 1) / n * full.numel() * full.element_size(), ranks, wire_factor=2 if gloo else 1)
        return self._c10d_reduce_scatter(output, full, group=group, async_op=async_op)

    def broadcast(self, tensor: torch.Tensor, *, src: int, group, async_op: bool = False):
        ranks = self._group_ranks(group)
        if len(ranks) == 1:
            return None
        self._count("broadcast", tensor.numel() * tensor.element_size(), ranks)
        return dist.broadcast(tensor, src=src, group=group, async_op=async_op)

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, group):
        """Chunk i (along dim 0) of `input` to group rank i; chunk i of `output` from group rank i."""
        ranks = self._group_ranks(group)
        n = len(ranks)
        if n == 1:
            output.copy_(input)
            return
        self._count("all_to_all", (n - 1) / n * input.numel() * input.element_size(), ranks)
        # Blocking (the CP core waits for its inputs): its whole time is time blocked on communication.
        self.time_stream_wait(lambda: dist.all_to_all_single(output, input, group=group))

    def all_to_all_uneven(self, output: torch.Tensor, input: torch.Tensor, *, output_splits: list[int],
                          input_splits: list[int], group, kind: str = "all_to_all"):
        """Rows input_splits[i] (along dim 0) of `input` to group rank i, output_splits[i] rows of `output`
        from it (the MoE token dispatch). Counted under `kind` (an uneven all-gather or reduce-scatter
        built from it counts as one): the rows that leave this rank."""
        ranks = self._group_ranks(group)
        if len(ranks) == 1:
            output.copy_(input)
            return
        me = ranks.index(dist.get_rank())
        row_bytes = input[0].numel() * input.element_size() if input.shape[0] else 0
        self._count(kind, (sum(input_splits) - input_splits[me]) * row_bytes, ranks)
        dist.all_to_all_single(output, input, output_split_sizes=output_splits, input_split_sizes=input_splits,
                               group=group)

    def exchange(self, send: torch.Tensor, recv: torch.Tensor, *, dst: int, src: int, group, tag: int = 0) -> list:
        """Send `send` to `dst` and receive `recv` from `src` at once (a ring step); returns the works.
        Under NCCL the two are one group of operations, so ranks that send to each other cannot
        deadlock on a stream that waits for its send before posting its receive."""
        if dist.get_backend(group) == "nccl":
            self._count("p2p", send.numel() * send.element_size(), (dist.get_rank(), dst))
            return dist.batch_isend_irecv([dist.P2POp(dist.isend, send, dst, group),
                                           dist.P2POp(dist.irecv, recv, src, group)])
        return [self.irecv(recv, src=src, group=group, tag=tag), self.isend(send, dst=dst, group=group, tag=tag)]

    # `tag` tells messages between one pair of ranks apart on gloo; NCCL ignores it and matches by order.
    def isend(self, tensor: torch.Tensor, *, dst: int, group=None, tag: int = 0):
        self._count("p2p", tensor.numel() * tensor.element_size(), (dist.get_rank(), dst))
        if _host_staged(tensor, group):
            host = tensor.to("cpu")
            return _Staged(dist.isend(host, dst=dst, group=group, tag=tag), keep=host)
        return dist.isend(tensor, dst=dst, group=group, tag=tag)

    def irecv(self, tensor: torch.Tensor, *, src: int, group=None, tag: int = 0):
        if _host_staged(tensor, group):
            host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
            return _Staged(dist.irecv(host, src=src, group=group, tag=tag), keep=host, into=tensor)
        return dist.irecv(tensor, src=src, group=group, tag=tag)

    def count_host_copy(self, tensor: torch.Tensor) -> None:
        """Count one device-host copy of `tensor` (no network link: not in intra_node / inter_node)."""
        self.counters.bytes_by_kind["host_device"] += tensor.numel() * tensor.element_size()

    def wait(self, work) -> None:
        """Wait for an async collective, counting the time blocked (module docstring)."""
        if work is not None:
            self.time_stream_wait(work.wait)

    def time_stream_wait(self, wait) -> None:
        """Run `wait()` (a collective's wait, or the current stream joining side streams), counting the
        CPU time blocked and, on CUDA, the current stream's stall behind it (events, read by `settle`)."""
        timed = self.device is not None and self.device.type == "cuda"
        start = time.perf_counter()
        if timed:
            before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            before.record()
        wait()
        if timed:
            after.record()
            self._stall_events.append((before, after))
        self.counters.wait_s += time.perf_counter() - start

    def settle(self) -> None:
        """Add the device stalls recorded since the last call to wait_s (after a device synchronisation)."""
        for before, after in self._stall_events:
            self.counters.wait_s += before.elapsed_time(after) / 1e3
        self._stall_events.clear()


def _host_staged(tensor: torch.Tensor, group) -> bool:
    """Whether a point-to-point message of `tensor` must go through host memory: a CUDA tensor on gloo."""
    return tensor.is_cuda and dist.get_backend(group) == "gloo"


class _Staged:
    """A gloo point-to-point message of a CUDA tensor through a host copy: `wait()` also copies a
    received message into its device tensor."""

    def __init__(self, work, *, keep: torch.Tensor, into: torch.Tensor | None = None) -> None:
        self.work, self.keep, self.into = work, keep, into

    def wait(self) -> bool:
        self.work.wait()
        if self.into is not None:
            self.into.copy_(self.keep)
            self.into = None
        return True

    def is_completed(self) -> bool:
        return self.work.is_completed()
