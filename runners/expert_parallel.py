"""Expert parallelism: tokens dispatched to the ranks that hold their experts and combined back, by all-to-all.

An EP group of `size` ranks holds num_experts / size experts each (expert e on EP rank e // local experts,
Megatron-Core's and torchtitan's placement). A rank's routed (token, expert) assignments, sorted by
expert, go to the experts' ranks by one all_to_all_single with uneven splits, after the per-expert counts
are exchanged so every rank knows what it receives; the received rows are regrouped by local expert for
the grouped expert GEMMs, and the outputs travel back by the reverse all-to-all. Both all-to-alls are
autograd functions whose backward is the other direction, so the router's and the experts' gradients
flow through them exactly.

Expert tensor parallelism (etp > 1, Megatron-Core's): the etp ranks of an ETP group hold the same experts,
each 1/etp of every expert's FFN width (w_gate and w_in by rows, w_out by columns). After the EP
all-to-all, the group all-gathers its received rows (uneven: each rank received its own count), so each
of its ranks runs every row of the group through its slice of the experts; the partial outputs are
reduce-scattered back to the rank that received each row (a sum over the etp slices), then return by the
reverse all-to-all. The gather's backward is that reduce-scatter and the other way round. Both go
through all_to_all_uneven (gloo has no uneven all-gather): the bytes on the wire are an all-gather's.

Own operators rather than torch's functional collectives for the same reason as tensor_parallel.py: every
collective goes through runners.comm (byte counters) on gloo and NCCL.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runners.comm import Comm


@dataclass
class EPContext:
    """This rank's expert-parallel group (size 1: every expert local, no collective) and its expert
    tensor-parallel group (etp_size 1: whole experts)."""

    group: object
    rank: int
    size: int
    comm: Comm | None
    etp_group: object = None
    etp_rank: int = 0
    etp_size: int = 1

    @classmethod
    def single(cls) -> "EPContext":
        return cls(group=None, rank=0, size=1, comm=None)

    @classmethod
    def from_mesh(cls, mesh, *, comm: Comm) -> "EPContext":
        if mesh.ep == 1 and mesh.etp == 1:
            return cls.single()
        return cls(group=mesh.groups.get("ep"), rank=mesh.ep_rank, size=mesh.ep, comm=comm,
                   etp_group=mesh.groups.get("etp"), etp_rank=mesh.etp_rank, etp_size=mesh.etp)


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


def _etp_gather(x: torch.Tensor, splits: list[int], ep: EPContext) -> torch.Tensor:
    """Every ETP rank's rows (splits[i] from rank i), concatenated in rank order."""
    out = x.new_empty((sum(splits), *x.shape[1:]))
    ep.comm.all_to_all_uneven(out, torch.cat([x] * ep.etp_size), output_splits=splits,
                              input_splits=[x.shape[0]] * ep.etp_size, group=ep.etp_group, kind="all_gather")
    return out


def _etp_reduce_scatter(x: torch.Tensor, splits: list[int], ep: EPContext) -> torch.Tensor:
    """The sum over ETP ranks of their rows splits[me] (x: every rank's rows in rank order, as gathered)."""
    mine = splits[ep.etp_rank]
    out = x.new_empty((mine * ep.etp_size, *x.shape[1:]))
    ep.comm.all_to_all_uneven(out, x.contiguous(), output_splits=[mine] * ep.etp_size, input_splits=splits,
                              group=ep.etp_group, kind="reduce_scatter")
    return out.view(ep.etp_size, mine, *x.shape[1:]).sum(0)


class _GatherETP(torch.autograd.Function):
    """The ETP group's received rows on every rank of it; backward sums each row's gradient over the
    group's ranks back to the rank that received it."""

    @staticmethod
    def forward(ctx, x, splits, ep):
        ctx.splits, ctx.ep = splits, ep
        return _etp_gather(x.contiguous(), splits, ep)

    @staticmethod
    def backward(ctx, grad):
        return _etp_reduce_scatter(grad, ctx.splits, ctx.ep), None, None


class _ReduceScatterETP(torch.autograd.Function):
    """Partial outputs of every row of the group (each rank's slice of the experts' width) summed on the
    rank that received the row; backward gathers the rows' gradients to every rank of the group."""

    @staticmethod
    def forward(ctx, x, splits, ep):
        ctx.splits, ctx.ep = splits, ep
        return _etp_reduce_scatter(x, splits, ep)

    @staticmethod
    def backward(ctx, grad):
        return _etp_gather(grad.contiguous(), ctx.splits, ctx.ep), None, None


@dataclass(frozen=True)
class Dispatch:
    """How one micro-batch's assignments travel: rows per destination and per source, and the
    permutation that groups the received rows by local expert."""

    send_splits: list[int]
    recv_splits: list[int]
    group_order: torch.Tensor  # received (and ETP-gathered) row indices, grouped by local expert
    ungroup_order: torch.Tensor  # its inverse
    tokens_per_local_expert: list[int]
    etp_splits: list[int]  # rows each ETP rank received by the all-to-all (etp > 1; else [])


def plan_dispatch(counts_per_expert: torch.Tensor, ep: EPContext) -> Dispatch:
    """Exchange per-expert counts ([num_experts] of my sorted assignments) and derive the splits."""
    local = counts_per_expert.numel() // ep.size
    send = counts_per_expert.view(ep.size, local)
    if ep.size > 1:
        recv = torch.empty_like(send)
        ep.comm.all_to_all(recv, send.contiguous(), ep.group)  # row i: what EP rank i sends to my experts
    else:
        recv = send
    if ep.etp_size > 1:  # the counts every rank of my ETP group received: [etp x ep, local]
        received = recv.new_empty((ep.etp_size * ep.size, local))
        ep.comm.all_gather(received, recv.contiguous(), ep.etp_group)
    else:
        received = recv
    # Rows come by (ETP rank,) source rank, each source's rows by local expert: regroup by local expert.
    expert_of_row = torch.arange(local).repeat(received.shape[0]).repeat_interleave(received.reshape(-1).cpu())
    group_order = torch.argsort(expert_of_row, stable=True)
    etp_splits = received.view(ep.etp_size, -1).sum(1).tolist() if ep.etp_size > 1 else []
    return Dispatch(send_splits=send.sum(1).tolist(), recv_splits=recv.sum(1).tolist(), group_order=group_order,
                    ungroup_order=torch.argsort(group_order), tokens_per_local_expert=received.sum(0).tolist(),
                    etp_splits=etp_splits)


def dispatch(rows: torch.Tensor, plan: Dispatch, ep: EPContext) -> torch.Tensor:
    """My assignment rows (sorted by expert) -> the rows my local experts process, grouped by expert."""
    if ep.size > 1:
        rows = _AllToAll.apply(rows, plan.send_splits, plan.recv_splits, ep)
    if ep.etp_size > 1:
        rows = _GatherETP.apply(rows, plan.etp_splits, ep)
    return rows[plan.group_order.to(rows.device)]


def combine(rows: torch.Tensor, plan: Dispatch, ep: EPContext) -> torch.Tensor:
    """The local experts' outputs (grouped by expert) -> my assignments' outputs, in dispatch order."""
    rows = rows[plan.ungroup_order.to(rows.device)]
    if ep.etp_size > 1:
        rows = _ReduceScatterETP.apply(rows, plan.etp_splits, ep)
    if ep.size > 1:
        rows = _AllToAll.apply(rows, plan.recv_splits, plan.send_splits, ep)
    return rows
