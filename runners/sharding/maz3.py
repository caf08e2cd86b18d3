"""MAZ3, memory-assisted ZeRO-3 (Liu et al., ICNP 2025): what happens to a layer's forward-gathered
parameters until its backward, per transformer layer (`plan.layer_cache(i)`; other units use "none").

- "none": freed, all-gathered again for backward (plain ZeRO-3);
- "device": kept gathered until the backward of the last micro-batch in flight (no backward gather);
- "host": copied to host memory after every forward and back before backward instead of the gather,
  counted as "host_device" bytes; on CUDA into pinned memory, both ways on the host-copy side stream
  (runners/sharding/streams.py), so the copies overlap compute: the backward waits only for its own
  copy (an event), which the gather side issues ahead of use like a prefetched gather;
- "secondary" (ZeRO++ hpZ): each rank keeps the 1/(param-group ranks in its node) slice and the backward
  gather runs inside the node.

Host and secondary copies are dropped once no micro-batch of the unit is in flight. The gather side
(runners/sharding/gather.py) calls `keep` after a forward and `fetch` before a backward."""

from __future__ import annotations

import torch

from runners.sharding.layout import DONE
from runners.sharding.streams import EventWork, SideStreams


class CacheTiers:
    def __init__(self, *, mesh, comm, track, streams: SideStreams | None = None) -> None:
        self.mesh, self.comm, self.track = mesh, comm, track  # track(delta_bytes): the live parameter bytes
        self.streams = streams

    def keep(self, u) -> None:
        """After u's forward: keep what its tier keeps of the gathered buffer (before it is freed)."""
        if u.tier == "host":
            self._copy_to_host(u)
        elif u.tier == "secondary":
            self._keep_secondary(u)

    def fetch(self, u):
        """Before u's backward, for a host or secondary layer with a forward in flight: fill u.flat from the
        kept copy (a host-to-device copy: returns DONE) or start the intra-node all-gather (returns its
        work); None when the tier keeps nothing to fetch from."""
        if u.num_in_flight == 0 or u.tier not in ("host", "secondary"):
            return None
        if u.tier == "host":
            self.comm.count_host_copy(u.flat)
            if not u.flat.is_cuda:
                u.flat.copy_(u.host)
                return DONE
            # After the buffer's allocation (compute stream); the device-to-host copy that filled u.host
            # ran earlier on the same side stream.
            with self._streams(u).on("host_copy"):
                u.flat.copy_(u.host, non_blocking=True)
                event = torch.cuda.Event()
                event.record()
            return EventWork(event)
        work = self.comm.all_gather(u.flat, u.secondary, self.mesh.param_intra_group, async_op=True)
        return DONE if work is None else work

    def drop(self, u) -> None:
        """No micro-batch of u is in flight any more: release its device-side copies."""
        if u.secondary is not None:
            self.track(-u.secondary.untyped_storage().nbytes())
            u.secondary = None
        # The host buffer itself stays allocated (pinned allocation is slow).

    def _copy_to_host(self, u) -> None:
        """Copy the gathered parameters to host memory; on CUDA, pinned and async on a side stream."""
        if u.host is None:
            u.host = torch.empty(u.padded, dtype=u.flat.dtype, device="cpu", pin_memory=u.flat.is_cuda)
        if u.flat.is_cuda:
            with self._streams(u).on("host_copy") as stream:  # after the forward that used the buffer
                u.host.copy_(u.flat, non_blocking=True)
            # The buffer is freed right after this: the allocator must not reuse it before the copy ends.
            u.flat.record_stream(stream)
        else:
            u.host.copy_(u.flat)
        self.comm.count_host_copy(u.flat)

    def _streams(self, u) -> SideStreams:
        if self.streams is None:
            self.streams = SideStreams(u.flat.device)
        return self.streams

    def _keep_secondary(self, u) -> None:
        """Keep my slice of the gathered buffer for the intra-node backward gather (ZeRO++ hpZ)."""
        ranks = self.mesh.param_intra_ranks
        mine = u.flat.view(len(ranks), -1)[ranks.index(self.mesh.rank)]
        if u.secondary is None:
            u.secondary = mine.clone()
            self.track(u.secondary.untyped_storage().nbytes())
        else:  # another micro-batch in flight: the same parameters
            u.secondary.copy_(mine)
