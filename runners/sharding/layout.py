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


def state_bytes_per_param(*, degrees: tuple[int, int, int], compute_bytes: int) -> float:
    """Bytes of parameter, gradient and optimizer state per model parameter this engine holds."""
    s_p, s_g, s_os = degrees
    optimizer_bytes = 8 if compute_bytes == 4 else 12  # m, v (+ fp32 master unless params are fp32)
    return compute_bytes / s_p + compute_bytes / s_g + optimizer_bytes / s_os


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


class FlatUnit:
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
        # buckets.GradientReducer.layout_grads.
        self.grad_numel = self.padded if s_g == 1 else self.padded // s_g
        self.grad = torch.empty(0, dtype=dtype, device=device)
        self.grad_views = s_g == 1
        self.rs_bucket = None  # s_g > 1: its buckets.ReduceScatterBucket
        self.rs_segments: list = []
        # MAZ3 copies of the forward-gathered parameters: host (kept allocated, pinned on CUDA) and the
        # secondary slice (device, dropped when nothing is in flight); forwards awaiting their backward.
        self.host: torch.Tensor | None = None
        self.host_event = None
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

    def optim_grad(self) -> torch.Tensor:
        """The gradient of my optimizer shard, in fp32 (a copy when gradients are in a 2-byte dtype)."""
        s_p, s_g, s_os = self.degrees
        k = s_os // s_g
        grad = self.grad.view(s_os, -1)[self.o_chunk] if s_g == 1 else self.grad.view(k, -1)[self.o_chunk % k]
        return grad.float()
