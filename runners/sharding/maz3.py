"""MAZ3, memory-assisted ZeRO-3 (Liu et al., ICNP 2025): what happens to a layer's forward-gathered
parameters until its backward, per transformer layer (`plan.layer_cache(i)`; other units use "none").

- "none": freed, all-gathered again for backward (plain ZeRO-3);
- "device": kept gathered until the backward of the last micro-batch in flight (no backward gather);
- "host": copied to host memory after every forward (pinned, on a side stream, on CUDA) and copied back
  before backward instead of the gather, counted as "host_device" bytes;
- "secondary" (ZeRO++ hpZ): each rank keeps the 1/(param-group ranks in its node) slice and the backward
  gather runs inside the node.

Host and secondary copies are dropped once no micro-batch of the unit is in flight. The gather side
(runners/sharding/gather.py) calls `keep` after a forward and `fetch` before a backward."""

from __future__ import annotations

import torch

from runners.sharding.layout import DONE


class CacheTiers:
    def __init__(self, *, mesh, comm, track) -> None:
        self.mesh, self.comm, self.track = mesh, comm, track  # track(delta_bytes): the live parameter bytes
        self._copy_stream = None  # CUDA side stream of the device-to-host copies

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
            if u.host_event is not None:  # the device-to-host copy on the side stream has landed
                torch.cuda.current_stream(u.flat.device).wait_event(u.host_event)
            u.flat.copy_(u.host, non_blocking=u.flat.is_cuda)
            self.comm.count_host_copy(u.flat)
            return DONE
        work = self.comm.all_gather(u.flat, u.secondary, self.mesh.param_intra_group, async_op=True)
        return DONE if work is None else work

    def drop(self, u) -> None:
        """No micro-batch of u is in flight any more: release its device-side copies."""
        if u.secondary is not None:
            self.track(-u.secondary.untyped_storage().nbytes())
            u.secondary = None
        u.host_event = None  # the host buffer itself stays allocated (pinned allocation is slow)

    def _copy_to_host(self, u) -> None:
        """Copy the gathered parameters to host memory; on CUDA, pinned and async on a side stream."""
        if u.host is None:
            u.host = torch.empty(u.padded, dtype=u.flat.dtype, device="cpu", pin_memory=u.flat.is_cuda)
        if u.flat.is_cuda:
            if self._copy_stream is None:
                self._copy_stream = torch.cuda.Stream(u.flat.device)
            self._copy_stream.wait_stream(torch.cuda.current_stream(u.flat.device))
            with torch.cuda.stream(self._copy_stream):
                u.host.copy_(u.flat, non_blocking=True)
                u.host_event = torch.cuda.Event()
                u.host_event.record()
            # The buffer is freed right after this: the allocator must not reuse it before the copy ends.
            u.flat.record_stream(self._copy_stream)
        else:
            u.host.copy_(u.flat)
        self.comm.count_host_copy(u.flat)

    def _keep_secondary(self, u) -> None:
        """Keep my slice of the gathered buffer for the intra-node backward gather (ZeRO++ hpZ)."""
        ranks = self.mesh.param_intra_ranks
        mine = u.flat.view(len(ranks), -1)[ranks.index(self.mesh.rank)]
        if u.secondary is None:
            u.secondary = mine.clone()
            self.track(u.secondary.untyped_storage().nbytes())
        else:  # another micro-batch in flight: the same parameters
            u.secondary.copy_(mine)
