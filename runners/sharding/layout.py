"""The nested shard layout and one unit's flat buffers (runners/sharding/__init__.py explains the layout).

A unit's flat buffer, padded to a multiple of s_os, is cut into s_p parameter chunks, each into
s_g / s_p gradient chunks, each into s_os / s_g optimizer chunks; DP position q holds parameter chunk
p(q), gradient chunk g(q) and optimizer chunk o(q) (`shard_chunks`).
"""

from __future__ import annotations

import math

import torch
from torch import nn


class _Done:
    """Marks a gather that needed no collective (a group of one, or a copy already made)."""


DONE = _Done()


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


def state_bytes_per_param(*, degrees: tuple[int, int, int], compute_bytes: int, grad_bytes: int | None = None) -> float:
    """Bytes of parameter, gradient and optimizer state per model parameter this engine holds (gradients
    in the compute dtype unless `grad_bytes` says otherwise: 4 under the plan's reduce_fp32)."""
    s_p, s_g, s_os = degrees
    optimizer_bytes = 8 if compute_bytes == 4 else 12  # m, v (+ fp32 master unless params are fp32)
    return compute_bytes / s_p + (grad_bytes or compute_bytes) / s_g + optimizer_bytes / s_os


def span(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """One 1-D view covering `tensors` if they lie back to back in one storage, in this order; else None."""
    first = tensors[0]
    offset = first.storage_offset()
    for t in tensors:
        if (t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() or t.dim() != 1
                or t.storage_offset() != offset):
            return None
        offset += t.numel()
    return first.as_strided((offset - first.storage_offset(),), (1,), first.storage_offset())


# Initial values are copied to the device in pieces of at most this many elements (bounds host staging).
INIT_COPY_ELEMENTS = 1 << 24


def flat_values(params: list[nn.Parameter], offsets: list[int], start: int, stop: int) -> torch.Tensor:
    """fp32 CPU values of flat positions [start, stop) of a unit (zeros in the padding): a parameter's own
    data where it has storage, else drawn from its ParamInit (runners/transformer.py: built deferred)."""
    out = torch.zeros(stop - start, dtype=torch.float32)
    for p, off in zip(params, offsets):
        lo, hi = max(start, off), min(stop, off + p.numel())
        if lo >= hi:
            continue
        if p.untyped_storage().nbytes() > 0:
            out[lo - start:hi - start] = p.detach().reshape(-1)[lo - off:hi - off].float().cpu()
        else:
            out[lo - start:hi - start] = p.init.values(lo - off, hi - off)
    return out


class FlatUnit:
    """One unit's flat parameter buffer, its shards and its per-step bookkeeping.

    Only what this rank holds is ever materialised on the device: the whole flat buffer when s_p == 1,
    else the parameter shard (the full buffer is allocated by each gather); the fp32 master covers the
    optimizer shard. Values come from `flat_values`, so a unit whose parameters were built deferred
    (no storage) starts from the same weights as one process without the full weight existing anywhere."""

    def __init__(self, module: nn.Module, params: list[nn.Parameter], *, chunk: int, position: int,
                 q: int, degrees: tuple[int, int, int], dtype: torch.dtype, tier: str = "none",
                 grad_dtype: torch.dtype | None = None, device: torch.device | None = None) -> None:
        self.module, self.params, self.chunk, self.position, self.tier = module, params, chunk, position, tier
        s_p, s_g, s_os = degrees
        self.degrees = degrees
        self.numel = sum(p.numel() for p in params)
        self.padded = math.ceil(self.numel / s_os) * s_os
        self.p_chunk, self.g_chunk, self.o_chunk = shard_chunks(q, degrees=degrees)
        device = device if device is not None else params[0].device
        self.offsets = []
        offset = 0
        for p in params:
            self.offsets.append(offset)
            offset += p.numel()
        self._shard_parameters(dtype=dtype, device=device)
        self.exp_avg = torch.zeros_like(self.master)
        self.exp_avg_sq = torch.zeros_like(self.master)
        # Gradients in the compute dtype (ZeRO's 2-byte gradients under mixed precision), or in fp32 under
        # the plan's reduce_fp32 (`grad_dtype`): the whole padded buffer (s_g == 1) or my 1/s_g chunk; a
        # view of its chunk's gradient buffer, assigned by buckets.GradientReducer.layout_grads. Each
        # p.grad is a view of it only when the dtypes agree (autograd keeps a parameter's dtype).
        self.grad_numel = self.padded if s_g == 1 else self.padded // s_g
        grad_dtype = grad_dtype or dtype
        self.grad = torch.empty(0, dtype=grad_dtype, device=device)
        self.grad_views = s_g == 1 and grad_dtype == dtype
        self.rs_bucket = None  # s_g > 1: its buckets.ReduceScatterBucket
        self.rs_segments: list = []
        # MAZ3 copies of the forward-gathered parameters: host (kept allocated, pinned on CUDA) and the
        # secondary slice (device, dropped when nothing is in flight); forwards awaiting their backward.
        self.host: torch.Tensor | None = None
        self.secondary: torch.Tensor | None = None
        self.num_in_flight = 0
        self.redistribution = None  # lins.Redistribution in flight that writes this unit's shard
        # Per-step state.
        self.gathered = s_p == 1
        self.gather_work = None
        self.in_backward = False
        self.num_grads_ready = 0
        self.num_backward = 0
        self.boundary_done = False   # its num_micro_batches-th backward has run
        self.rs_reduced = s_g == 1   # its boundary reduce-scatter has landed in self.grad

    def _shard_parameters(self, *, dtype: torch.dtype, device: torch.device) -> None:
        """Copy my 1/s_p of the parameters' values into param_shard, take the optimizer's slice of it and
        its fp32 master, and make every parameter a view of the unit's flat buffer (freed at once when
        parameters are sharded: one unit at a time is ever whole while building)."""
        params = self.params
        s_p, _, s_os = self.degrees
        shard = self.padded // s_p
        self.param_shard = torch.empty(shard, dtype=dtype, device=device)
        # Read the parameters' values (their own storage or their ParamInit) before they become views.
        start = self.p_chunk * shard
        with torch.no_grad():
            for lo in range(0, shard, INIT_COPY_ELEMENTS):
                hi = min(shard, lo + INIT_COPY_ELEMENTS)
                self.param_shard[lo:hi].copy_(flat_values(params, self.offsets, start + lo, start + hi))
        # The optimizer's slice of my parameter shard, and its fp32 master (the slice itself if fp32).
        k = s_os // s_p
        self.param_slice = self.param_shard.view(k, -1)[self.o_chunk % k]
        if dtype == torch.float32:
            self.master = self.param_slice
        else:
            size = self.padded // s_os
            self.master = flat_values(params, self.offsets, self.o_chunk * size, (self.o_chunk + 1) * size).to(device)
        self.flat = torch.empty(self.padded, dtype=dtype, device=device) if s_p > 1 else self.param_shard
        self.flat_bytes = self.flat.untyped_storage().nbytes()
        for p, off in zip(params, self.offsets):
            p.data = self.flat[off:off + p.numel()].view(p.shape)
        if s_p > 1:
            self.flat.untyped_storage().resize_(0)  # one unit at a time is ever whole while building

    def optim_grad(self) -> torch.Tensor:
        """The gradient of my optimizer shard, in fp32 (a copy when gradients are in a 2-byte dtype)."""
        s_p, s_g, s_os = self.degrees
        k = s_os // s_g
        grad = self.grad.view(s_os, -1)[self.o_chunk] if s_g == 1 else self.grad.view(k, -1)[self.o_chunk % k]
        return grad.float()
