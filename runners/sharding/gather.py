"""Parameter gathering under s_p > 1: a unit's parameters live as a 1/s_p shard; they are all-gathered
in the s_p group before the unit's forward and again before its backward (or fetched from a MAZ3 tier,
runners/sharding/maz3.py), and the gathered buffer is freed after each (its storage resized to zero,
FSDP1-style, so the module's parameter views stay valid). `prefetch_depth` units ahead (behind, in
backward) are gathered asynchronously; the wait is just before use. On CUDA a rate limiter (FSDP's
limit_all_gathers) keeps the CPU from issuing gathers far ahead of the kernels that free their buffers:
before a gather, once `max(2, prefetch_depth + 1)` freed buffers are not yet known to be free on the
device, the CPU waits for the oldest (an event recorded at its free), so gathered memory stays within
the prefetch window the cost model prices.

Before a unit's first gather of a step its Lins redistribution must have landed (the shard it gathers
is the updated one): `lins.await_unit`, looked up at call time."""

from __future__ import annotations

from collections import deque

import torch

from runners.sharding.layout import DONE
from runners.sharding.maz3 import CacheTiers


class ParameterGather:
    def __init__(self, units_by_chunk: list[list], *, s_p: int, prefetch_depth: int, mesh, comm, lins,
                 streams=None) -> None:
        self.units_by_chunk, self.s_p, self.prefetch_depth = units_by_chunk, s_p, prefetch_depth
        self.mesh, self.comm, self.lins = mesh, comm, lins
        self.tiers = CacheTiers(mesh=mesh, comm=comm, track=self.track, streams=streams)
        self.max_freed_ahead = max(2, prefetch_depth + 1)
        self.free_events: deque = deque()  # CUDA: one event per freed buffer, oldest first
        units = [u for chunk in units_by_chunk for u in chunk]
        # Parameter storage held now: gathered buffers plus (under s_p > 1) the persistent shards.
        self.live_param_bytes = sum(u.flat.untyped_storage().nbytes() + (u.param_shard.untyped_storage().nbytes()
                                                                         if u.param_shard is not u.flat else 0)
                                    for u in units)
        self.peak_param_bytes = self.live_param_bytes

    # --- module hooks (registered by the engine) ------------------------------------------------------
    def pre_forward(self, u) -> None:
        self.lins.await_unit(u)
        self.ensure_gathered(u)
        if not u.in_backward and self.s_p > 1:
            self._prefetch(u, step=+1)

    def post_forward(self, u) -> None:
        # A recomputation inside backward (checkpoint around the unit) must keep the parameters.
        if u.in_backward or self.s_p == 1:
            return
        if not torch.is_grad_enabled():  # no backward follows: nothing to cache
            self.free(u)
            return
        u.num_in_flight += 1
        if u.tier == "device":
            return  # stays gathered until the backward of the last micro-batch in flight
        self.tiers.keep(u)
        self.free(u)

    def pre_backward(self, u) -> None:
        u.in_backward = True
        self.ensure_gathered(u, backward=True)
        if self.s_p > 1:
            self._prefetch(u, step=-1)

    # --- gathering --------------------------------------------------------------------------------
    def _issue(self, u, *, backward: bool = False) -> None:
        """Start filling u's full parameter buffer: a MAZ3 tier's copy for a backward use, else an
        all-gather in the param group."""
        if u.gathered or u.gather_work is not None:
            return
        self.lins.await_unit(u)
        self._limit_rate()
        self._resize(u, u.flat_bytes)
        work = self.tiers.fetch(u) if backward else None
        if work is None:
            work = self.comm.all_gather(u.flat, u.param_shard, self.mesh.param_group, async_op=True)
        u.gather_work = work if work is not None else DONE

    def ensure_gathered(self, u, *, backward: bool = False) -> None:
        if u.gathered:
            return
        self._issue(u, backward=backward)
        if u.gather_work is not DONE:
            self.comm.wait(u.gather_work)
        u.gather_work, u.gathered = None, True

    def free(self, u) -> None:
        if self.s_p == 1 or not u.gathered:
            return
        self._resize(u, 0)
        u.gathered = False
        if u.flat.is_cuda:
            event = torch.cuda.Event()
            event.record()
            self.free_events.append(event)

    def _limit_rate(self) -> None:
        """Before allocating another gathered buffer: wait until the device has passed the free of all but
        the newest `max_freed_ahead - 1` freed buffers (FSDP's rate limiter; a no-op on CPU)."""
        while len(self.free_events) >= self.max_freed_ahead:
            self.free_events.popleft().synchronize()

    def _prefetch(self, u, *, step: int) -> None:
        units = self.units_by_chunk[u.chunk]
        for d in range(1, self.prefetch_depth + 1):
            i = u.position + step * d
            if 0 <= i < len(units):
                self._issue(units[i], backward=step < 0)

    # --- memory accounting ------------------------------------------------------------------------
    def _resize(self, u, num_bytes: int) -> None:
        """Allocate or release a unit's gathered buffer, tracking the live and peak parameter bytes from
        the storage sizes before and after."""
        storage = u.flat.untyped_storage()
        before = storage.nbytes()
        storage.resize_(num_bytes)
        self.track(storage.nbytes() - before)

    def track(self, delta_bytes: int) -> None:
        self.live_param_bytes += delta_bytes
        self.peak_param_bytes = max(self.peak_param_bytes, self.live_param_bytes)
