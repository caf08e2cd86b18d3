"""Data-parallel sharding engine: per-unit flat buffers, three sharding degrees, Adam on fp32 shards.

Parameters, gradients and optimizer states are sharded over their own degree of the DP group,
s_p | s_g | s_os | dp (Lins' generalisation of ZeRO; ZeRO-0..3 and HSDP/MiCS are points of it), one
*unit* (embedding, transformer block, head) at a time. The semantics are the ones the cost model prices:

- s_p > 1: a unit's parameters live as a 1/s_p shard; they are all-gathered in the s_p group before the
  unit's forward and again before its backward, and the gathered buffer is freed (its storage resized to
  zero, FSDP1-style, so the module's parameter views stay valid) after each. `prefetch_depth` units
  ahead (behind, in backward) are gathered asynchronously; the wait is just before use.
- s_g == 1: the full fp32 gradient is accumulated over micro-batches and all-reduced (sum) over the DP
  group at the accumulation boundary. s_g > 1: after every micro-batch's backward of a unit, its
  gradient is reduce-scattered in the s_g group into an fp32 shard; the shard is all-reduced across the
  dp / s_g replica groups only at the boundary. Reductions are bucketed (`bucket_size_bytes`, units in
  backward order) and asynchronous; the boundary of a unit is its num_micro_batches-th backward of the
  step, so pipeline schedules whose chunks finish at different times work unchanged.
- Adam (exactly torch.optim.Adam's single-tensor arithmetic) on the 1/s_os shard with fp32 master
  weights, then the updated shards are all-gathered inside the s_os / s_p ranks that share my parameter
  shard (nothing when s_os == s_p). Lins (Chen et al., IWQoS 2024, AMSP): that redistribution is issued
  asynchronously at the end of optimizer_step and overlaps the next step's forward; each unit waits for
  its bucket in its forward pre-hook (before its first gather), and everything that reads parameters
  outside forward (full_state_dict, local_state, load_local_state, the next optimizer_step) waits first.
- MAZ3, memory-assisted ZeRO-3 (Liu et al., ICNP 2025), per transformer layer (`plan.layer_cache(i)`;
  units that are not transformer blocks use "none"). What happens to a layer's forward-gathered
  parameters until its backward: "none" freed, all-gathered again for backward (plain ZeRO-3);
  "device" kept gathered until the backward of the last micro-batch in flight (no backward gather);
  "host" copied to host memory after every forward (pinned, on a side stream, on CUDA) and copied back
  before backward instead of the gather, counted as "host_device" bytes; "secondary" (ZeRO++ hpZ) each
  rank keeps the 1/(param-group ranks in its node) slice and the backward gather runs inside the node.
  Host and secondary copies are dropped once no micro-batch of the unit is in flight.
- Commshift (Hosoki et al., CCGrid 2025), defer_grad_sync: every gradient reduction of a chunk's last
  micro-batch (its reduce-scatter and the boundary all-reduce) waits for start_grad_sync(chunk), which
  the pipeline calls right after the chunk's last input-gradient send, so it never delays that send.

Nested shard layout (so each rank's optimizer shard lies inside its gradient shard, inside its parameter
shard): a unit's flat buffer, padded to a multiple of s_os, is cut into s_p parameter chunks, each into
s_g / s_p gradient chunks, each into s_os / s_g optimizer chunks. DP position q holds parameter chunk
p(q) = q % s_p, gradient chunk g(q) = p(q) * (s_g/s_p) + (q % s_g) // s_p and optimizer chunk
o(q) = g(q) * (s_os/s_g) + (q % s_os) // s_g (`shard_chunks`). Collectives put chunk i on *group rank*
i, and groups are sorted consecutive DP positions, so the parameter all-gather is direct while the
gradient reduce-scatter and the optimizer redistribution permute chunks while packing their buckets
(a no-op for ZeRO-0..3 and HSDP, a copy only for mixes such as (2, 4, 4)).

Precision: parameters are held in the compute dtype (`param_dtype`, default the modules' dtype), and so
are gradients, accumulated and reduced in it (Rajbhandari et al., "ZeRO", SC'20, section 3.1: fp16
parameters and gradients); the optimizer keeps fp32 master weights (the parameter shard itself when that
is fp32) and fp32 Adam moments, and Adam reads the gradient shard upcast to fp32. The state bytes per
parameter are then the ZeRO paper's: bf16/fp16: 2/s_p + 2/s_g + 12/s_os (16, 4 + 12/N, 2 + 14/N, 16/N for
ZeRO-0..3); fp32: 4/s_p + 4/s_g + 8/s_os (`state_bytes_per_param`).

All ranks of a DP group must start with identical parameters (same seed); nothing is broadcast.
"""

from __future__ import annotations

import math
import warnings
from collections import deque
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from specs.errors import PlannerError

# The first unit's input (token ids) needs no gradient, so torch warns that its full backward hook fires
# on the outputs' gradients; the pre-hook is exactly that, and the warning would repeat every step.
warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed with "
                        "respect to module outputs")


def shard_chunks(q: int, *, degrees: tuple[int, int, int]) -> tuple[int, int, int]:
    """(parameter, gradient, optimizer) chunk indices of DP position q under degrees (s_p, s_g, s_os).

    The chunks nest: gradient chunk g covers optimizer chunks g*(s_os/s_g) .. (g+1)*(s_os/s_g) - 1 and lies
    in parameter chunk g // (s_g/s_p); inside one s_os group the map q -> o is a bijection (a mixed-radix
    split of q % s_os), and ranks of a replica group (equal q % s_g) hold equal gradient chunks.
    """
    s_p, s_g, s_os = degrees
    p = q % s_p
    g = p * (s_g // s_p) + (q % s_g) // s_p
    o = g * (s_os // s_g) + (q % s_os) // s_g
    return p, g, o


def state_bytes_per_param(*, degrees: tuple[int, int, int], compute_bytes: int) -> float:
    """Bytes of parameter, gradient and optimizer state per model parameter this engine holds."""
    s_p, s_g, s_os = degrees
    optimizer_bytes = 8 if compute_bytes == 4 else 12  # m, v (+ fp32 master unless params are fp32)
    return compute_bytes / s_p + compute_bytes / s_g + optimizer_bytes / s_os


@dataclass(eq=False)
class _Redistribution:
    """One bucket of the asynchronous optimizer-shard redistribution (Lins) and the units it writes."""
    work: object
    unpack: Callable[[], None]
    units: list


@dataclass
class _Pending:
    """An in-flight collective; `on_done` runs once it completes, `keep` holds its buffers alive."""
    work: object
    on_done: Callable[[], None]
    keep: tuple


class _RSBucket:
    """Consecutive units of one chunk (backward order) whose gradients are reduce-scattered together.

    Each micro-batch's gradients are written straight into `send`, laid out rank-major (row r holds
    gradient chunk g(r) of every unit, units side by side), so the collective needs no packing copy and no
    full-size per-unit scratch. The units' reduced gradient shards are views of one contiguous `grad`, so
    the first micro-batch of a step reduce-scatters into it directly."""

    def __init__(self, units: list, *, s_g: int, degrees: tuple[int, int, int], dtype: torch.dtype,
                 device: torch.device) -> None:
        self.units, self.s_g, self.dtype, self.device = units, s_g, dtype, device
        self.row = sum(u.padded // s_g for u in units)
        self.grad = _span([u.grad for u in units])
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


class _Unit:
    """One unit's flat parameter buffer, its shards and its per-step bookkeeping."""

    def __init__(self, module: nn.Module, params: list[nn.Parameter], *, chunk: int, position: int,
                 q: int, degrees: tuple[int, int, int], dtype: torch.dtype, tier: str = "none") -> None:
        self.module, self.params, self.chunk, self.position, self.tier = module, params, chunk, position, tier
        s_p, s_g, s_os = degrees
        self.degrees = degrees
        self.numel = sum(p.numel() for p in params)
        self.padded = math.ceil(self.numel / s_os) * s_os
        self.p_chunk, self.g_chunk, self.o_chunk = shard_chunks(q, degrees=degrees)
        device = params[0].device
        original = torch.zeros(self.padded, dtype=torch.float32, device=device)
        offset = 0
        self.offsets = []
        with torch.no_grad():
            for p in params:
                self.offsets.append(offset)
                original[offset:offset + p.numel()].copy_(p.detach().reshape(-1))
                offset += p.numel()
        self.flat = original.to(dtype) if dtype != torch.float32 else original
        self.flat_bytes = self.flat.untyped_storage().nbytes()
        for p, off in zip(params, self.offsets):
            p.data = self.flat[off:off + p.numel()].view(p.shape)
        if s_p > 1:
            self.param_shard = self.flat.view(s_p, -1)[self.p_chunk].clone()
            self.flat.untyped_storage().resize_(0)  # one unit at a time is ever whole while building
        else:
            self.param_shard = self.flat
        # The optimizer's slice of my parameter shard, and its fp32 master (the slice itself if fp32).
        k = s_os // s_p
        self.param_slice = self.param_shard.view(k, -1)[self.o_chunk % k]
        if dtype == torch.float32:
            self.master = self.param_slice
        else:
            self.master = original.view(s_os, -1)[self.o_chunk].clone()
        del original
        self.exp_avg = torch.zeros_like(self.master)
        self.exp_avg_sq = torch.zeros_like(self.master)
        # Gradients in the compute dtype (ZeRO's 2-byte gradients under mixed precision): the whole
        # padded buffer (s_g == 1) or my 1/s_g chunk; a view of its chunk's gradient buffer, assigned by
        # ShardedDataParallel._layout_grads.
        self.grad_numel = self.padded if s_g == 1 else self.padded // s_g
        self.grad = torch.empty(0, dtype=dtype, device=device)
        self.grad_views = s_g == 1
        self.rs_bucket: _RSBucket | None = None  # s_g > 1: set by ShardedDataParallel._build_rs_buckets
        self.rs_segments: list = []
        # MAZ3 copies of the forward-gathered parameters: host (kept allocated, pinned on CUDA) and the
        # secondary slice (device, dropped when nothing is in flight); forwards awaiting their backward.
        self.host: torch.Tensor | None = None
        self.host_event = None
        self.secondary: torch.Tensor | None = None
        self.num_in_flight = 0
        self.redistribution: _Redistribution | None = None
        # Per-step state.
        self.gathered = s_p == 1
        self.gather_work = None
        self.in_backward = False
        self.num_grads_ready = 0
        self.num_backward = 0
        self.boundary_done = False   # its num_micro_batches-th backward has run
        self.rs_reduced = s_g == 1   # its boundary reduce-scatter has landed in self.grad

    def optim_grad(self) -> torch.Tensor:
        """The gradient of my optimizer shard, in fp32 (a copy when gradients are in a 2-byte dtype)."""
        s_p, s_g, s_os = self.degrees
        k = s_os // s_g
        grad = self.grad.view(s_os, -1)[self.o_chunk] if s_g == 1 else self.grad.view(k, -1)[self.o_chunk % k]
        return grad.float()


class ShardedDataParallel:
    """Trains a rank's model chunks under the plan's DP sharding (see the module docstring).

    Use: run forward/backward of every micro-batch through the chunks as usual (the hooks gather, free
    and reduce), then `optimizer_step()`; under defer_grad_sync the pipeline calls `start_grad_sync(c)`
    right after chunk c's last input-gradient send. `full_state_dict()` gathers the parameters for tests;
    `local_state()` / `load_local_state()` save and restore this rank's shards.

    Args:
        chunks: this rank's model chunks, each with `units: nn.ModuleList` run in order by its forward.
        plan: the plan (dp, shard degrees, prefetch_depth, bucket_size_bytes, pp).
        mesh: runners.mesh.Mesh of this process. comm: runners.comm.Comm that counts every collective.
        num_micro_batches: backward passes of every unit per step (the accumulation boundary).
        defer_grad_sync: issue each chunk's last-micro-batch reduce-scatter and boundary all-reduce only at
            start_grad_sync(chunk) (Commshift).
        param_dtype: compute dtype of the parameters (default: the modules'); the master stays fp32.
    """

    def __init__(self, chunks, *, plan, mesh, comm, num_micro_batches: int, lr: float,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 defer_grad_sync: bool = False, param_dtype: torch.dtype | None = None) -> None:
        if num_micro_batches < 1:
            raise PlannerError(f"num_micro_batches must be at least 1, got {num_micro_batches}")
        self.chunks, self.plan, self.mesh, self.comm = list(chunks), plan, mesh, comm
        self.num_micro_batches = num_micro_batches
        self.lr, self.betas, self.eps, self.weight_decay = lr, betas, eps, weight_decay
        self.defer_grad_sync = defer_grad_sync
        self.degrees = plan.shard_degrees
        self.num_steps = 0
        self._pending: deque[_Pending] = deque()
        self._boundary_queue: deque[_Unit] = deque()
        self._deferred_rs: list[list[_RSBucket]] = []  # per chunk: last micro-batch's, for start_grad_sync
        self._boundary_bucket: list[_Unit] = []
        self._released: set[int] = set()
        self._redistributions: deque[_Redistribution] = deque()
        self._copy_stream = None  # CUDA side stream of the MAZ3 device-to-host copies
        self.peak_param_bytes = 0
        self._build_units(param_dtype)
        self._layout_grads()
        self._build_rs_buckets()
        self._register_hooks()

    # --- construction ----------------------------------------------------------------------------
    def _build_units(self, param_dtype: torch.dtype | None) -> None:
        self.units_by_chunk: list[list[_Unit]] = []
        self.names: dict[int, str] = {}
        seen: dict[int, str] = {}
        for v, chunk in enumerate(self.chunks):
            c = v * self.mesh.pp + self.mesh.pp_rank  # the global chunk id, as the pipeline names chunks
            for name, p in chunk.named_parameters():
                self.names[id(p)] = f"{c}.{name}"
            units = []
            for i, module in enumerate(chunk.units):
                params = [p for p in module.parameters() if p.requires_grad]
                for p in params:
                    if id(p) in seen:
                        raise PlannerError(f"parameter {self.names.get(id(p))} is in two units ({seen[id(p)]} and "
                                           f"chunk {v} unit {i}); flat-parameter sharding needs each in one unit")
                    seen[id(p)] = f"chunk {v} unit {i}"
                if not params:
                    continue
                dtype = param_dtype or params[0].dtype
                # Only transformer blocks carry a layer index; the plan's MAZ3 tiers are per layer.
                layer = getattr(module, "layer_index", None)
                tier = self.plan.layer_cache(layer) if layer is not None else "none"
                units.append(_Unit(module, params, chunk=v, position=len(units), q=self.mesh.dp_rank,
                                   degrees=self.degrees, dtype=dtype, tier=tier))
            self.units_by_chunk.append(units)
        self.units = [u for units in self.units_by_chunk for u in units]
        # Parameter storage held now: gathered buffers plus (under s_p > 1) the persistent shards.
        self.live_param_bytes = sum(u.flat.untyped_storage().nbytes() + (u.param_shard.untyped_storage().nbytes()
                                                                         if u.param_shard is not u.flat else 0)
                                    for u in self.units)
        self.peak_param_bytes = self.live_param_bytes

    def _layout_grads(self) -> None:
        """One gradient buffer per chunk, its units in backward order, so every bucket (consecutive units
        of a chunk in backward order) is one contiguous view that its collective reduces in place. Under
        s_g == 1 each p.grad is a view of it, so autograd's AccumulateGrad adds in place and no copy is
        needed (torch DDP's gradient_as_bucket_view)."""
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
        self._deferred_rs = [[] for _ in self.units_by_chunk]
        s_g = self.degrees[1]
        if s_g == 1:
            return
        for units in self.units_by_chunk:
            current: list[_Unit] = []
            for u in reversed(units):
                current.append(u)
                full = sum(x.padded * x.grad.element_size() for x in current) >= self.plan.bucket_size_bytes
                if full or u.position == 0:
                    dtypes = {x.grad.dtype for x in current}
                    assert len(dtypes) == 1, "one reduce-scatter bucket mixes gradient dtypes"
                    _RSBucket(current, s_g=s_g, degrees=self.degrees, dtype=current[0].grad.dtype,
                              device=current[0].grad.device)
                    current = []

    def _register_hooks(self) -> None:
        for u in self.units:
            u.module.register_forward_pre_hook(lambda m, args, u=u: self._pre_forward(u))
            if self.degrees[0] > 1:  # parameters to free after forward and gather before backward
                u.module.register_forward_hook(lambda m, args, out, u=u: self._post_forward(u))
                u.module.register_full_backward_pre_hook(lambda m, grad_out, u=u: self._pre_backward(u))
            for i, p in enumerate(u.params):
                p.register_post_accumulate_grad_hook(lambda p, u=u, i=i: self._on_grad(u, i))

    # --- parameter gathering -------------------------------------------------------------------
    def _issue_gather(self, u: _Unit, *, backward: bool = False) -> None:
        """Start filling u's full parameter buffer: an all-gather in the param group, or for a backward
        use of a MAZ3 host / secondary layer, a host-to-device copy / an intra-node all-gather."""
        if u.gathered or u.gather_work is not None:
            return
        self._await_redistribution(u)
        self._resize(u, u.flat_bytes)
        work = None
        if backward and u.tier == "host" and u.num_in_flight > 0:
            if u.host_event is not None:  # the device-to-host copy on the side stream has landed
                torch.cuda.current_stream(u.flat.device).wait_event(u.host_event)
            u.flat.copy_(u.host, non_blocking=u.flat.is_cuda)
            self.comm.count_host_copy(u.flat)
        elif backward and u.tier == "secondary" and u.num_in_flight > 0:
            work = self.comm.all_gather(u.flat, u.secondary, self.mesh.param_intra_group, async_op=True)
        else:
            work = self.comm.all_gather(u.flat, u.param_shard, self.mesh.param_group, async_op=True)
        u.gather_work = work if work is not None else _DONE

    def _ensure_gathered(self, u: _Unit, *, backward: bool = False) -> None:
        if u.gathered:
            return
        self._issue_gather(u, backward=backward)
        if u.gather_work is not _DONE:
            self.comm.wait(u.gather_work)
        u.gather_work, u.gathered = None, True

    def _free(self, u: _Unit) -> None:
        if self.degrees[0] == 1 or not u.gathered:
            return
        self._resize(u, 0)
        u.gathered = False

    def _resize(self, u: _Unit, num_bytes: int) -> None:
        """Allocate or release a unit's gathered buffer, tracking the live and peak parameter bytes from
        the storage sizes before and after."""
        storage = u.flat.untyped_storage()
        before = storage.nbytes()
        storage.resize_(num_bytes)
        self._track(storage.nbytes() - before)

    def _prefetch(self, u: _Unit, *, step: int) -> None:
        units = self.units_by_chunk[u.chunk]
        for d in range(1, self.plan.prefetch_depth + 1):
            i = u.position + step * d
            if 0 <= i < len(units):
                self._issue_gather(units[i], backward=step < 0)

    def _pre_forward(self, u: _Unit) -> None:
        self._await_redistribution(u)
        self._ensure_gathered(u)
        if not u.in_backward and self.degrees[0] > 1:
            self._prefetch(u, step=+1)

    def _post_forward(self, u: _Unit) -> None:
        # A recomputation inside backward (checkpoint around the unit) must keep the parameters.
        if u.in_backward or self.degrees[0] == 1:
            return
        if not torch.is_grad_enabled():  # no backward follows: nothing to cache
            self._free(u)
            return
        u.num_in_flight += 1
        if u.tier == "device":
            return  # stays gathered until the backward of the last micro-batch in flight
        if u.tier == "host":
            self._copy_to_host(u)
        elif u.tier == "secondary":
            self._keep_secondary(u)
        self._free(u)

    def _pre_backward(self, u: _Unit) -> None:
        u.in_backward = True
        self._ensure_gathered(u, backward=True)
        if self.degrees[0] > 1:
            self._prefetch(u, step=-1)

    # --- MAZ3 caches ----------------------------------------------------------------------------
    def _copy_to_host(self, u: _Unit) -> None:
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

    def _keep_secondary(self, u: _Unit) -> None:
        """Keep my slice of the gathered buffer for the intra-node backward gather (ZeRO++ hpZ)."""
        ranks = self.mesh.param_intra_ranks
        mine = u.flat.view(len(ranks), -1)[ranks.index(self.mesh.rank)]
        if u.secondary is None:
            u.secondary = mine.clone()
            self._track(u.secondary.untyped_storage().nbytes())
        else:  # another micro-batch in flight: the same parameters
            u.secondary.copy_(mine)

    def _drop_caches(self, u: _Unit) -> None:
        """No micro-batch of u is in flight any more: release its device-side MAZ3 copies."""
        if u.secondary is not None:
            self._track(-u.secondary.untyped_storage().nbytes())
            u.secondary = None
        u.host_event = None  # the host buffer itself stays allocated (pinned allocation is slow)

    def _track(self, delta_bytes: int) -> None:
        self.live_param_bytes += delta_bytes
        self.peak_param_bytes = max(self.peak_param_bytes, self.live_param_bytes)

    # --- gradients ------------------------------------------------------------------------------
    def _on_grad(self, u: _Unit, i: int) -> None:
        """A parameter's gradient of this micro-batch is complete: move it into the flat gradient storage
        (s_g == 1, normally already there as a view) or its bucket's rank-major send buffer (s_g > 1)."""
        p = u.params[i]
        if u.grad_views:
            if p.grad.data_ptr() != u.grad[u.offsets[i]:].data_ptr():
                # autograd replaced the view (it may, e.g. for a gradient of another layout)
                with torch.no_grad():
                    u.grad[u.offsets[i]:u.offsets[i] + p.numel()].add_(p.grad.reshape(-1))
                p.grad = u.grad[u.offsets[i]:u.offsets[i] + p.numel()].view(p.shape)
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
        if u.num_grads_ready == len(u.params):
            u.num_grads_ready = 0
            self._unit_backward_done(u)

    def _unit_backward_done(self, u: _Unit) -> None:
        u.in_backward = False
        u.num_backward += 1
        if u.num_backward > self.num_micro_batches:
            raise RuntimeError(f"unit {u.position} of chunk {u.chunk} ran backward {u.num_backward} times in one "
                               f"step, but num_micro_batches is {self.num_micro_batches}; call optimizer_step()")
        u.num_in_flight = max(0, u.num_in_flight - 1)
        if u.num_in_flight == 0:
            self._drop_caches(u)
        if u.tier != "device" or u.num_in_flight == 0:
            self._free(u)
        boundary = u.num_backward == self.num_micro_batches
        if self.degrees[1] > 1:
            bucket = u.rs_bucket
            bucket.num_done += 1
            if bucket.num_done == len(bucket.units):
                bucket.num_done, bucket.boundary = 0, boundary
                if boundary and self.defer_grad_sync:  # Commshift: reduce at start_grad_sync(chunk)
                    self._deferred_rs[u.chunk].append(bucket)
                else:
                    self._flush_rs(bucket)
        if boundary:
            u.boundary_done = True
            if not self.defer_grad_sync:
                self._queue_boundary(u)
        self._poll()

    def _flush_rs(self, bucket: _RSBucket) -> None:
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

        work = self.comm.reduce_scatter(recv, send, self.mesh.grad_group, async_op=True)
        self._pending.append(_Pending(work, on_done, (send, recv)))

    def _queue_boundary(self, u: _Unit) -> None:
        # The queue order is fixed by deterministic events (backward order, start_grad_sync calls), so
        # every rank issues the boundary collectives in the same order.
        self._boundary_queue.append(u)
        self._pump()

    def start_grad_sync(self, chunk: int) -> None:
        """Issue the last micro-batch's reduce-scatter and the boundary reduction of global chunk id `chunk`
        (c = v * pp + pp_rank, as the pipeline schedule names chunks), for defer_grad_sync mode; a second
        call in a step is a no-op."""
        v, rest = divmod(chunk - self.mesh.pp_rank, self.mesh.pp)
        if rest or not 0 <= v < len(self.chunks):
            raise RuntimeError(f"start_grad_sync({chunk}): chunk {chunk} is not on pipeline rank {self.mesh.pp_rank}")
        if v in self._released:
            return
        units = self.units_by_chunk[v]
        for u in reversed(units):
            if not u.boundary_done:
                raise RuntimeError(f"start_grad_sync({chunk}) before unit {u.position}'s last backward of the step")
        self._released.add(v)
        deferred, self._deferred_rs[v] = self._deferred_rs[v], []
        for bucket in deferred:  # backward order, as the hooks would have issued them
            self._flush_rs(bucket)
        for u in reversed(units):
            self._queue_boundary(u)

    def _boundary_group(self):
        s_g = self.degrees[1]
        return (self.mesh.dp_group, self.plan.dp) if s_g == 1 else (self.mesh.grad_replica_group, self.plan.dp // s_g)

    def _pump(self) -> None:
        """Move ready units from the boundary queue into the all-reduce bucket, flushing when due."""
        group, size = self._boundary_group()
        while self._boundary_queue and self._boundary_queue[0].rs_reduced:
            u = self._boundary_queue.popleft()
            if size == 1:
                continue
            self._boundary_bucket.append(u)
            full = sum(x.grad.numel() * x.grad.element_size() for x in self._boundary_bucket) >= self.plan.bucket_size_bytes
            if full or u.position == 0:
                self._flush_boundary(group)

    def _flush_boundary(self, group) -> None:
        units, self._boundary_bucket = self._boundary_bucket, []
        span = _span([u.grad for u in units])
        if span is not None:  # consecutive units of a chunk: reduce their buffer in place
            work = self.comm.all_reduce(span, group, async_op=True)
            self._pending.append(_Pending(work, lambda: None, ()))
            return
        buffer = torch.cat([u.grad for u in units])

        def on_done() -> None:
            offset = 0
            for u in units:
                u.grad.copy_(buffer[offset:offset + u.grad.numel()])
                offset += u.grad.numel()

        work = self.comm.all_reduce(buffer, group, async_op=True)
        self._pending.append(_Pending(work, on_done, (buffer,)))

    def _poll(self) -> None:
        """Finish completed collectives in issue order (never blocking)."""
        progressed = False
        while self._pending and (self._pending[0].work is None or self._pending[0].work.is_completed()):
            self._finish(self._pending.popleft())
            progressed = True
        if progressed:
            self._pump()

    def _finish(self, pending: _Pending) -> None:
        if pending.work is not None:
            self.comm.wait(pending.work)
        pending.on_done()

    def _drain(self) -> None:
        """Wait for every gradient collective, issuing the boundary ones that depend on earlier ones."""
        while self._pending or self._boundary_queue:
            assert self._pending, "boundary queue stalled with nothing in flight"
            self._finish(self._pending.popleft())
            self._pump()
        assert not self._boundary_bucket

    # --- optimizer ----------------------------------------------------------------------------
    def unit_grad(self, module: nn.Module) -> torch.Tensor:
        """The gradient (compute dtype) this rank holds for unit `module`: the whole flat buffer when s_g == 1, else
        its gradient chunk g(q); final (reduced over DP) inside optimizer_step's `before_update`. Two
        units of equal size (a tied embedding and output projection) have chunks that line up."""
        for u in self.units:
            if u.module is module:
                return u.grad
        raise KeyError(f"{type(module).__name__} is not a unit with trainable parameters")

    def optimizer_step(self, *, before_update: Callable[[], None] | None = None) -> None:
        """Wait for the gradient reductions, Adam-step my shard, redistribute, and zero the gradients.

        `before_update` runs once the gradients are reduced and before Adam reads them (e.g. to sum the
        gradients of tied copies through unit_grad). The redistribution of the updated shards is left in
        flight (Lins); the next forward waits for it unit by unit."""
        self._finish_redistributions()
        for u in self.units:
            if u.num_backward != self.num_micro_batches:
                raise RuntimeError(f"unit {u.position} of chunk {u.chunk} ran backward {u.num_backward} times this "
                                   f"step, expected num_micro_batches = {self.num_micro_batches}")
        if self.defer_grad_sync:  # chunks the pipeline did not release yet
            for v in reversed(range(len(self.chunks))):
                self.start_grad_sync(v * self.mesh.pp + self.mesh.pp_rank)
        self._drain()
        if before_update is not None:
            before_update()
        self.num_steps += 1
        with torch.no_grad():
            for u in self.units:
                self._adam(u)
            self._redistribute()
        for u in self.units:
            u.grad.zero_()
            u.num_backward = 0
            u.boundary_done = False
            u.rs_reduced = self.degrees[1] == 1
        self._released.clear()

    def _adam(self, u: _Unit) -> None:
        """torch.optim.Adam's single-tensor update (weight_decay as L2 added to the gradient)."""
        beta1, beta2 = self.betas
        grad = u.optim_grad()
        if self.weight_decay != 0:
            grad = grad.add(u.master, alpha=self.weight_decay)
        u.exp_avg.lerp_(grad, 1 - beta1)
        u.exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        step = float(self.num_steps)
        bias_correction1 = 1 - beta1 ** step
        bias_correction2 = 1 - beta2 ** step
        step_size = self.lr / bias_correction1
        denom = (u.exp_avg_sq.sqrt() / bias_correction2 ** 0.5).add_(self.eps)
        u.master.addcdiv_(u.exp_avg, denom, value=-step_size)
        if u.master is not u.param_slice:
            u.param_slice.copy_(u.master)

    def _redistribute(self) -> None:
        """Issue the all-gathers of the updated optimizer shards among the s_os/s_p ranks sharing my
        parameter shard, in buckets of units in forward order; `_await_redistribution` finishes them."""
        s_p, _, s_os = self.degrees
        k = s_os // s_p
        if k == 1:
            return
        q = self.mesh.dp_rank
        base = q - q % s_os + q % s_p
        subs = [shard_chunks(base + j * s_p, degrees=self.degrees)[2] % k for j in range(k)]
        buckets, current, current_bytes = [], [], 0
        for u in self.units:
            current.append(u)
            current_bytes += u.param_shard.numel() * u.param_shard.element_size()
            if current_bytes >= self.plan.bucket_size_bytes:
                buckets.append(current)
                current, current_bytes = [], 0
        if current:
            buckets.append(current)
        for units in buckets:
            work, unpack = self._gather_bucket(units, subs)
            pending = _Redistribution(work, unpack, units)
            self._redistributions.append(pending)
            for u in units:
                u.redistribution = pending

    def _await_redistribution(self, u: _Unit) -> None:
        """Wait until u's parameter shard holds the last step's update (a no-op once it does)."""
        pending = u.redistribution
        if pending is None:
            return
        self.comm.wait(pending.work)
        pending.unpack()
        for x in pending.units:
            x.redistribution = None
        self._redistributions.remove(pending)

    def _finish_redistributions(self) -> None:
        """Wait for every redistribution still in flight (before reading parameters outside forward)."""
        while self._redistributions:
            self._await_redistribution(self._redistributions[0].units[0])

    def _gather_bucket(self, units: list[_Unit], subs: list[int]):
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

    # --- state ----------------------------------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full parameters (gathered, compute dtype) named '<global chunk id>.<name in the chunk>' (as
        runners.model.canonical_names keys them); a collective over the parameter group."""
        out: dict[str, torch.Tensor] = {}
        s_p = self.degrees[0]
        self._finish_redistributions()
        for u in self.units:
            flat = u.flat
            if s_p > 1:
                flat = torch.empty(u.padded, dtype=u.param_shard.dtype, device=u.param_shard.device)
                self.comm.all_gather(flat, u.param_shard, self.mesh.param_group)
            for p, off in zip(u.params, u.offsets):
                out[self.names[id(p)]] = flat[off:off + p.numel()].view(p.shape).clone()
        return out

    def local_state(self) -> dict[str, torch.Tensor]:
        """This rank's shards (parameters, fp32 master, Adam moments) and the step count, for checkpoints."""
        self._finish_redistributions()
        state = {"num_steps": torch.tensor(self.num_steps)}
        for i, u in enumerate(self.units):
            state[f"unit{i}.param_shard"] = u.param_shard.clone()
            state[f"unit{i}.master"] = u.master.clone()
            state[f"unit{i}.exp_avg"] = u.exp_avg.clone()
            state[f"unit{i}.exp_avg_sq"] = u.exp_avg_sq.clone()
        return state

    def load_local_state(self, state: dict[str, torch.Tensor]) -> None:
        expected = {"num_steps"} | {f"unit{i}.{k}" for i in range(len(self.units))
                                    for k in ("param_shard", "master", "exp_avg", "exp_avg_sq")}
        if set(state) != expected:
            bad = sorted(set(state) ^ expected)[0]
            raise PlannerError(f"checkpoint state does not match this engine's shards: key {bad!r}")
        self._finish_redistributions()  # an in-flight update would overwrite the loaded shards
        self.num_steps = int(state["num_steps"])
        with torch.no_grad():
            for i, u in enumerate(self.units):
                for key in ("param_shard", "master", "exp_avg", "exp_avg_sq"):
                    target = getattr(u, key)
                    if target.shape != state[f"unit{i}.{key}"].shape:
                        raise PlannerError(f"checkpoint unit{i}.{key} has shape {tuple(state[f'unit{i}.{key}'].shape)}, "
                                           f"expected {tuple(target.shape)}")
                    target.copy_(state[f"unit{i}.{key}"])

    def state_bytes(self) -> dict[str, int]:
        """Bytes of storage this rank holds now, by kind (distinct storages only)."""
        seen: set[int] = set()

        def size(t: torch.Tensor) -> int:
            storage = t.untyped_storage()
            if storage.data_ptr() in seen or storage.nbytes() == 0:
                return 0
            seen.add(storage.data_ptr())
            return storage.nbytes()

        kinds = {"params": 0, "grads": 0, "optimizer": 0}
        for u in self.units:
            kinds["params"] += size(u.flat) + size(u.param_shard)
            kinds["grads"] += size(u.grad)
            kinds["optimizer"] += size(u.master) + size(u.exp_avg) + size(u.exp_avg_sq)
        return kinds


def _span(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """One 1-D view covering `tensors` if they lie back to back in one storage, in this order; else None."""
    first = tensors[0]
    offset = first.storage_offset()
    for t in tensors:
        if (t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() or t.dim() != 1
                or t.storage_offset() != offset):
            return None
        offset += t.numel()
    return first.as_strided((offset - first.storage_offset(),), (1,), first.storage_offset())


class _Done:
    """Marks a gather that needed no collective (a group of one)."""


_DONE = _Done()
