"""The cluster: nodes of identical devices, and which process groups stay inside a node.

Ranks are laid out as in Megatron-LM: tensor parallel innermost, then data parallel, then pipeline
(rank = ((pp_index * dp) + dp_index) * tp + tp_index), so TP groups are the most local, and a data-parallel
sharding group of `s` consecutive DP positions covers `s * tp` consecutive ranks.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from specs.hardware import Hardware


@dataclass(frozen=True)
class Cluster:
    num_nodes: int
    devices_per_node: int
    hardware: Hardware

    def __post_init__(self) -> None:
        if self.num_nodes < 1:
            raise ValueError(f"num_nodes must be at least 1, got {self.num_nodes}")
        if self.devices_per_node < 1:
            raise ValueError(f"devices_per_node must be at least 1, got {self.devices_per_node}")

    @functools.cached_property
    def collective_memo(self) -> dict:
        """The cost model's memo of collective times on this cluster (cost_models/estimate.py
        `collective_time_s`): a Cluster and its Hardware are immutable, so a time once priced stays right.
        Not a field: equality, JSON and `dataclasses.replace` do not see it."""
        return {}

    @property
    def num_devices(self) -> int:
        return self.num_nodes * self.devices_per_node

    def group_link(self, *, size: int, stride: int) -> str:
        """'intra_node' if a group of `size` ranks spaced `stride` apart fits in one node, else 'inter_node'.

        Groups are aligned (they start at a multiple of size * stride), so the group fits iff its span
        `size * stride` is at most a node, or it is a single rank.
        """
        if size <= 1:
            return "intra_node"
        return "intra_node" if size * stride <= self.devices_per_node else "inter_node"

    def ranks_per_node_in_group(self, *, size: int, stride: int) -> int:
        """Members of the group that share one node (the intra-node factor of the group)."""
        if stride >= self.devices_per_node:
            return 1
        return max(1, min(size, self.devices_per_node // stride))


def make_cluster(*, hardware: Hardware, num_devices: int, devices_per_node: int | None) -> Cluster:
    """A cluster of `num_devices` devices, `devices_per_node` per node (default: 8 for GPUs, all for CPU)."""
    from specs.errors import PlannerError

    if num_devices < 1:
        raise PlannerError(f"--gpus must be at least 1, got {num_devices}")
    per_node = devices_per_node or (8 if hardware.device_type == "cuda" else num_devices)
    per_node = min(per_node, num_devices)
    if per_node < 1:
        raise PlannerError(f"--gpus-per-node must be at least 1, got {per_node}")
    if num_devices % per_node:
        raise PlannerError(f"--gpus {num_devices} is not a multiple of --gpus-per-node {per_node}")
    return Cluster(num_nodes=num_devices // per_node, devices_per_node=per_node, hardware=hardware)
