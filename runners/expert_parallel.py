"""Expert parallelism: tokens dispatched to the ranks that hold their experts and combined back, by all-to-all.

An EP group of `size` ranks holds num_experts / size experts each (expert e on EP rank e // local experts,
Megatron-Core's and torchtitan's placement). A rank's routed (token, expert) assignments, sorted by
expert, go to the experts' ranks by one all_to_all_single with uneven splits, after the per-expert counts
are exchanged so every rank knows what it receives; the received rows are regrouped by local expert for
the grouped expert GEMMs, and the outputs travel back by the reverse all-to-all. Both all-to-alls are
autograd functions whose backward is the other direction, so the router's and the experts' gradients
flow through them exactly. Own operators rather than torch's functional collectives for the same reason
as tensor_parallel.py: every collective goes through runners.comm (byte counters) on gloo and NCCL.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runners.comm import Comm


@dataclass
class EPContext:
    """This rank's expert-parallel group (size 1: every expert local, no collective)."""

    group: object
    rank: int
    size: int
    comm: Comm | None

    @classmethod
    def single(cls) -> "EPContext":
        return cls(group=None, rank=0, size=1, comm=None)

    @classmethod
    def from_mesh(cls, mesh, *, comm: Comm) -> "EPContext":
        if mesh.ep == 1:
            return cls.single()
        return cls(group=mesh.ep_group, rank=mesh.ep_rank, size=mesh.ep, comm=comm)


class _AllToAll(torch.autograd.Function):
    """Rows send_splits[i] to EP rank i, recv_splits[i] from it; backward sends the gradients home."""

    @staticmethod
    def forward(ctx, x, send_splits, recv_splits, ep):
        ctx.send_splits, ctx.recv_splits, ctx.ep = send_splits, recv_splits, ep
        return _all_to_all(x.contiguous(), send_splits=send_splits, recv_splits=recv_splits, ep=ep)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad.contiguous(), send_splits=ctx.recv_splits, recv_splits=ctx.send_splits,
                           ep=ctx.ep), None, None, None


def _all_to_all(x: torch.Tensor, *, send_splits: list[int], recv_splits: list[int], ep: EPContext) -> torch.Tensor:
    out = x.new_empty((sum(recv_splits), *x.shape[1:]))
    ep.comm.all_to_all_uneven(out, x, output_splits=recv_splits, input_splits=send_splits, group=ep.group)
    return out


@dataclass(frozen=True)
class Dispatch:
    """How one micro-batch's assignments travel: rows per destination and per source, and the
    permutation that groups the received rows by local expert."""

    send_splits: list[int]
    recv_splits: list[int]
    group_order: torch.Tensor  # received row indices, grouped by local expert
    ungroup_order: torch.Tensor  # its inverse
    tokens_per_local_expert: list[int]


def plan_dispatch(counts_per_expert: torch.Tensor, ep: EPContext) -> Dispatch:
    """Exchange per-expert counts ([num_experts] of my sorted assignments) and derive the splits."""
    local = counts_per_expert.numel() // ep.size
    send = counts_per_expert.view(ep.size, local)
    if ep.size > 1:
        recv = torch.empty_like(send)
        ep.comm.all_to_all(recv, send.contiguous(), ep.group)  # row i: what EP rank i sends to my experts
    else:
        recv = send
    # Received rows come by source rank, each source's rows by local expert: regroup by local expert.
    expert_of_row = torch.arange(local).repeat(ep.size).repeat_interleave(recv.reshape(-1).cpu())
    group_order = torch.argsort(expert_of_row, stable=True)
    return Dispatch(send_splits=send.sum(1).tolist(), recv_splits=recv.sum(1).tolist(), group_order=group_order,
                    ungroup_order=torch.argsort(group_order), tokens_per_local_expert=recv.sum(0).tolist())


def dispatch(rows: torch.Tensor, plan: Dispatch, ep: EPContext) -> torch.Tensor:
    """My assignment rows (sorted by expert) -> the rows my local experts process, grouped by expert."""
    if ep.size > 1:
        rows = _AllToAll.apply(rows, plan.send_splits, plan.recv_splits, ep)
    return rows[plan.group_order.to(rows.device)]


def combine(rows: torch.Tensor, plan: Dispatch, ep: EPContext) -> torch.Tensor:
    """The local experts' outputs (grouped by expert) -> my assignments' outputs, in dispatch order."""
    rows = rows[plan.ungroup_order.to(rows.device)]
    if ep.size > 1:
        rows = _AllToAll.apply(rows, plan.recv_splits, plan.send_splits, ep)
    return rows
