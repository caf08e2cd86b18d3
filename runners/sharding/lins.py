"""Lins (Chen et al., IWQoS 2024, AMSP): after the optimizer step, the updated optimizer shards are
all-gathered inside the s_os / s_p ranks that share a parameter shard (nothing when s_os == s_p).

The redistribution is issued asynchronously at the end of the step, bucket by bucket in forward order,
and overlaps the next step's forward: a unit waits for its bucket just before its first gather
(`await_unit`), and everything that reads parameters outside forward waits for all (`finish_all`)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable

import torch

from runners.sharding.layout import shard_chunks


@dataclass(eq=False)
class Redistribution:
    """One bucket of the redistribution in flight and the units it writes."""
    work: object
    unpack: Callable[[], None]
    units: list


class Redistributor:
    def __init__(self, units: list, *, degrees: tuple[int, int, int], mesh, comm, bucket_size_bytes: int) -> None:
        self.units, self.degrees, self.mesh, self.comm = units, degrees, mesh, comm
        self.bucket_size_bytes = bucket_size_bytes
        self.in_flight: deque[Redistribution] = deque()

    def issue(self) -> None:
        """All-gather the updated optimizer shards among the s_os/s_p ranks sharing my parameter shard, in
        buckets of units in forward order."""
        s_p, _, s_os = self.degrees
        k = s_os // s_p
        if k == 1:
            return
        q = self.mesh.shard_rank
        base = q - q % s_os + q % s_p
        subs = [shard_chunks(base + j * s_p, degrees=self.degrees)[2] % k for j in range(k)]
        buckets, current, current_bytes = [], [], 0
        for u in self.units:
            current.append(u)
            current_bytes += u.param_shard.numel() * u.param_shard.element_size()
            if current_bytes >= self.bucket_size_bytes:
                buckets.append(current)
                current, current_bytes = [], 0
        if current:
            buckets.append(current)
        for units in buckets:
            work, unpack = self._gather_bucket(units, subs)
            pending = Redistribution(work, unpack, units)
            self.in_flight.append(pending)
            for u in units:
                u.redistribution = pending

    def await_unit(self, u) -> None:
        """Wait until u's parameter shard holds the last step's update (a no-op once it does)."""
        pending = u.redistribution
        if pending is None:
            return
        self.comm.wait(pending.work)
        pending.unpack()
        for x in pending.units:
            x.redistribution = None
        self.in_flight.remove(pending)

    def finish_all(self) -> None:
        """Wait for every redistribution still in flight (before reading parameters outside forward)."""
        while self.in_flight:
            self.await_unit(self.in_flight[0].units[0])

    def _gather_bucket(self, units: list, subs: list[int]):
        k = len(subs)
        send = torch.cat([u.param_slice for u in units])
        recv = torch.empty(send.numel() * k, dtype=send.dtype, device=send.device)
        work = self.comm.all_gather(recv, send, self.mesh.redistribute_group, async_op=True)

        def unpack() -> None:
            segments = recv.view(k, -1)
            for j, sub in enumerate(subs):
                offset = 0
                for u in units:
                    size = u.param_slice.numel()
                    u.param_shard.view(k, -1)[sub].copy_(segments[j, offset:offset + size])
                    offset += size

        return work, unpack
