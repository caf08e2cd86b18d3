"""Gradient reduction: bucketed, asynchronous reduce-scatters per micro-batch and all-reduces at the
accumulation boundary.

s_g == 1: the full gradient (compute dtype) is accumulated over micro-batches in place and all-reduced
(sum) over the DP group at the boundary. s_g > 1: after every micro-batch's backward of a unit its
gradient is reduce-scattered in the s_g group into the unit's gradient shard; the shard is all-reduced
across the dp / s_g replica groups only at the boundary. Buckets hold consecutive units of a chunk in
backward order (`bucket_size_bytes`); the boundary of a unit is its num_micro_batches-th backward of the
step, so pipeline schedules whose chunks finish at different times work unchanged. One gradient buffer
per chunk, its units in backward order, makes every bucket one contiguous view its collective reduces
in place; under s_g == 1 each p.grad is a view of it (torch DDP's gradient_as_bucket_view).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable

import torch

from runners.sharding.layout import shard_chunks, span


@dataclass
class Pending:
    """An in-flight collective; `on_done` runs once it completes, `keep` holds its buffers alive."""
    work: object
    on_done: Callable[[], None]
    keep: tuple


class ReduceScatterBucket:
    """Consecutive units of one chunk (backward order) whose gradients are reduce-scattered together.

    Each micro-batch's gradients are written straight into `send`, laid out rank-major (row r holds
    gradient chunk g(r) of every unit, units side by side), so the collective needs no packing copy and no
    full-size per-unit scratch. The units' reduced gradient shards are views of one contiguous `grad`, so
    the first micro-batch of a step reduce-scatters into it directly."""

    def __init__(self, units: list, *, s_g: int, degrees: tuple[int, int, int], dtype: torch.dtype,
                 device: torch.device) -> None:
        self.units, self.s_g, self.dtype, self.device = units, s_g, dtype, device
        self.row = sum(u.padded // s_g for u in units)
        self.grad = span([u.grad for u in units])
        assert self.grad is not None, "a reduce-scatter bucket's gradient shards are not adjacent"
        rank_of_chunk = [0] * s_g  # the gradient group rank that receives chunk k
        for r in range(s_g):
            rank_of_chunk[shard_chunks(r, degrees=degrees)[1]] = r
        self.pad_segments: list[tuple[int, int]] = []  # (destination, length) to zero in a new send
        offset = 0
        for u in units:
            size = u.padded // s_g
            u.rs_bucket = self
            # For each parameter (and the padding tail): pieces (source offset, length, destination).
            u.rs_segments = [self._pieces(off, p.numel(), size, offset, rank_of_chunk)
                             for p, off in zip(u.params, u.offsets)]
            self.pad_segments += [(dst, n) for _, n, dst in
                                  self._pieces(u.numel, u.padded - u.numel, size, offset, rank_of_chunk)]
            offset += size
        self.send: torch.Tensor | None = None
        self.num_done = 0
        self.boundary = False

    def _pieces(self, start: int, length: int, size: int, offset: int, rank_of_chunk: list[int]):
        """Flat positions [start, start + length) of a unit (gradient chunks of `size`, the unit at
        column `offset` of each row) as (source offset, length, destination in send) pieces."""
        pieces, pos = [], start
        while pos < start + length:
            k = pos // size
            end = min(start + length, (k + 1) * size)
            pieces.append((pos - start, end - pos, rank_of_chunk[k] * self.row + offset + pos - k * size))
            pos = end
        return pieces

    def new_send(self) -> torch.Tensor:
        send = torch.empty(self.s_g * self.row, dtype=self.dtype, device=self.device)
        for dst, n in self.pad_segments:
            send[dst:dst + n].zero_()
        return send


class GradientReducer:
    """Owns the gradient buffers, the buckets and every gradient collective of one rank's chunks."""

    def __init__(self, units_by_chunk: list[list], *, plan, mesh, comm, deferred, streams=None,
                 ordered: bool = False) -> None:
        """`ordered`: collectives are ordered on the device (NCCL; runners/sharding/streams.py): each
        reduction is chained on the side `streams` as it is issued instead of being polled for."""
        self.units_by_chunk, self.plan, self.mesh, self.comm, self.deferred = units_by_chunk, plan, mesh, comm, deferred
        self.degrees = plan.shard_degrees
        self.streams, self.ordered = streams, ordered
        assert streams is not None or not ordered, "the ordered reducer needs side streams"
        # Ordered mode: buffers side streams may still read or write; released only once the current
        # stream has joined them (freed earlier, the allocator could hand them to compute meanwhile).
        self.held: list[tuple] = []
        self.pending: deque[Pending] = deque()
        self.boundary_queue: deque = deque()
        self.boundary_bucket: list = []
        # Test hook (runners/mutations.py, "skip_reduction"): a unit whose buckets' reductions are not
        # issued (only at micro-batch skip_micro_batch, if set), each rank keeping its local share; None
        # outside tests.
        self.skip_unit, self.skip_micro_batch = None, None
        self._layout_grads()
        self._build_rs_buckets()

    # --- construction --------------------------------------------------------------------------------
    def _layout_grads(self) -> None:
        for units in self.units_by_chunk:
            if not units:
                continue
            buffer = torch.zeros(sum(u.grad_numel for u in units), dtype=units[0].grad.dtype,
                                 device=units[0].grad.device)
            offset = 0
            for u in reversed(units):
                assert u.grad.dtype == buffer.dtype, "one chunk's units have different gradient dtypes"
                u.grad = buffer[offset:offset + u.grad_numel]
                offset += u.grad_numel
                if u.grad_views:
                    for p, off in zip(u.params, u.offsets):
                        p.grad = u.grad[off:off + p.numel()].view(p.shape)

    def _build_rs_buckets(self) -> None:
        """Group each chunk's units in backward order into reduce-scatter buckets of at least
        bucket_size_bytes of full gradient (a chunk's first unit closes its last bucket)."""
        s_g = self.degrees[1]
        if s_g == 1:
            return
        for units in self.units_by_chunk:
            current: list = []
            for u in reversed(units):
                current.append(u)
                full = sum(x.padded * x.grad.element_size() for x in current) >= self.plan.bucket_size_bytes
                if full or u.position == 0:
                    assert len({x.grad.dtype for x in current}) == 1, "one reduce-scatter bucket mixes gradient dtypes"
                    ReduceScatterBucket(current, s_g=s_g, degrees=self.degrees, dtype=current[0].grad.dtype,
                                        device=current[0].grad.device)
                    current = []

    # --- per micro-batch ------------------------------------------------------------------------------
    def on_grad(self, u, i: int) -> bool:
        """Parameter i's gradient of this micro-batch is complete: move it into the flat gradient storage
        (s_g == 1, normally already there as a view) or its bucket's rank-major send buffer (s_g > 1).
        Returns True when it was the unit's last parameter."""
        p = u.params[i]
        if u.grad_views:
            if p.grad.data_ptr() != u.grad[u.offsets[i]:].data_ptr():
                # autograd replaced the view (it may, e.g. for a gradient of another layout)
                with torch.no_grad():
                    u.grad[u.offsets[i]:u.offsets[i] + p.numel()].add_(p.grad.reshape(-1))
                p.grad = u.grad[u.offsets[i]:u.offsets[i] + p.numel()].view(p.shape)
        elif u.rs_bucket is None:  # s_g == 1 with fp32 gradients of lower-precision parameters: accumulate
            with torch.no_grad():
                u.grad[u.offsets[i]:u.offsets[i] + p.numel()].add_(p.grad.reshape(-1))
            p.grad = None
        else:
            bucket = u.rs_bucket
            if bucket.send is None:
                bucket.send = bucket.new_send()
            grad = p.grad.reshape(-1)
            with torch.no_grad():
                for src, n, dst in u.rs_segments[i]:
                    bucket.send[dst:dst + n].copy_(grad[src:src + n])
            p.grad = None
        u.num_grads_ready += 1
        if u.num_grads_ready < len(u.params):
            return False
        u.num_grads_ready = 0
        return True

    def unit_done(self, u, *, boundary: bool) -> None:
        """u's backward of this micro-batch is done (`boundary`: its last of the step): reduce-scatter its
        bucket when the bucket is complete, and at the boundary queue u's all-reduce (both held back for
        Commshift at the boundary)."""
        if self.degrees[1] > 1:
            bucket = u.rs_bucket
            bucket.num_done += 1
            if bucket.num_done == len(bucket.units):
                bucket.num_done, bucket.boundary = 0, boundary
                if boundary and self.deferred.enabled:
                    self.deferred.hold(u.chunk, bucket)
                else:
                    self._flush_rs(bucket)
        if boundary:
            u.boundary_done = True
            if not self.deferred.enabled:
                self._queue_boundary(u)
        self.poll()

    def release(self, v: int) -> None:
        """Commshift: issue local chunk v's held reduce-scatters and queue its boundary all-reduces (a
        second call in a step is a no-op)."""
        if v in self.deferred.released:
            return
        units = self.units_by_chunk[v]
        for u in reversed(units):
            if not u.boundary_done:
                raise RuntimeError(f"start_grad_sync before unit {u.position}'s last backward of the step")
        for bucket in self.deferred.release(v):  # backward order, as the hooks would have issued them
            self._flush_rs(bucket)
        for u in reversed(units):
            self._queue_boundary(u)

    def _skipped(self, units: list) -> bool:
        if self.skip_unit is None or self.skip_unit not in units:
            return False
        return self.skip_micro_batch is None or self.skip_micro_batch == units[0].num_backward - 1

    def _flush_rs(self, bucket: ReduceScatterBucket) -> None:
        """Reduce-scatter a bucket's send buffer in the s_g group; row r (chunk g(r) of each unit) goes to
        group rank r. The first micro-batch of the step lands straight in the bucket's gradient shards."""
        send, bucket.send = bucket.send, None
        first = bucket.units[0].num_backward == 1
        recv = bucket.grad if first else torch.empty_like(bucket.grad)
        boundary = bucket.units if bucket.boundary else []

        def on_done() -> None:
            if not first:
                bucket.grad.add_(recv)
            for u in boundary:
                u.rs_reduced = True

        if self._skipped(bucket.units):  # the injected missing reduction (tests only)
            recv.copy_(send.view(len(self.mesh.grad_ranks), -1)[self.mesh.grad_ranks.index(self.mesh.rank)])
            self.pending.append(Pending(None, on_done, (send, recv)))
            return
        if not self.ordered:
            work = self.comm.reduce_scatter(recv, send, self.mesh.grad_group, async_op=True)
            self.pending.append(Pending(work, on_done, (send, recv)))
            return
        with self.streams.on("reduce_scatter"):  # after the backward that wrote `send`
            if not first:
                recv = torch.empty_like(bucket.grad)  # allocated on the stream that uses it
            work = self.comm.reduce_scatter(recv, send, self.mesh.grad_group, async_op=True)
            if work is not None:
                work.wait()  # the reduce-scatter stream waits for the collective; the CPU does not
            on_done()  # the add runs on the reduce-scatter stream, after the collective
        self.held.append((send, recv, work))

    # --- the boundary all-reduce -------------------------------------------------------------------------
    def _queue_boundary(self, u) -> None:
        # The queue order is fixed by deterministic events (backward order, start_grad_sync calls), so
        # every rank issues the boundary collectives in the same order.
        self.boundary_queue.append(u)
        self._pump()

    def _boundary_group(self):
        s_g = self.degrees[1]
        return (self.mesh.dp_group, self.plan.dp_cp) if s_g == 1 else (self.mesh.grad_replica_group, self.plan.dp_cp // s_g)

    def _pump(self) -> None:
        """Move ready units from the boundary queue into the all-reduce bucket, flushing when due."""
        group, size = self._boundary_group()
        while self.boundary_queue and self.boundary_queue[0].rs_reduced:
            u = self.boundary_queue.popleft()
            if size == 1:
                continue
            self.boundary_bucket.append(u)
            full = sum(x.grad.numel() * x.grad.element_size() for x in self.boundary_bucket) >= self.plan.bucket_size_bytes
            if full or u.position == 0:
                self._flush_boundary(group)

    def _flush_boundary(self, group) -> None:
        units, self.boundary_bucket = self.boundary_bucket, []
        if self._skipped(units):  # the injected missing reduction (tests only)
            return
        if not self.ordered:
            self._all_reduce(units, group)
            return
        # After the backward (s_g == 1: the gradients it accumulated) and the reduce-scatters (s_g > 1).
        with self.streams.on("all_reduce", after=("reduce_scatter",)):
            self._all_reduce(units, group)

    def _all_reduce(self, units: list, group) -> None:
        whole = span([u.grad for u in units])
        buffer = whole if whole is not None else torch.cat([u.grad for u in units])

        def on_done() -> None:
            if whole is not None:  # consecutive units of a chunk: reduced in place
                return
            offset = 0
            for u in units:
                u.grad.copy_(buffer[offset:offset + u.grad.numel()])
                offset += u.grad.numel()

        work = self.comm.all_reduce(buffer, group, async_op=True)
        if self.ordered:  # the all-reduce stream waits for the collective, then copies back
            if work is not None:
                work.wait()
            on_done()
            self.held.append((buffer, work))
            return
        self.pending.append(Pending(work, on_done, (buffer,)))

    # --- completion --------------------------------------------------------------------------------------
    def poll(self) -> None:
        """Finish completed collectives in issue order (never blocking)."""
        progressed = False
        while self.pending and (self.pending[0].work is None or self.pending[0].work.is_completed()):
            self._finish(self.pending.popleft())
            progressed = True
        if progressed:
            self._pump()

    def _finish(self, pending: Pending) -> None:
        if pending.work is not None:
            self.comm.wait(pending.work)
        pending.on_done()

    def drain(self) -> None:
        """Wait for every gradient collective, issuing the boundary ones that depend on earlier ones."""
        while self.pending or self.boundary_queue:
            assert self.pending, "boundary queue stalled with nothing in flight"
            self._finish(self.pending.popleft())
            self._pump()
        assert not self.boundary_bucket
        if self.ordered:  # the optimizer (compute stream) reads what the side streams wrote
            self.comm.time_stream_wait(self.streams.join)
            self.held.clear()
