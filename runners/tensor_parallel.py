"""Megatron-style tensor parallelism: the conjugate communication operators and vocab-parallel loss.

Shoeybi et al. 2019 (Megatron-LM) define f (identity forward, all-reduce backward) before a
column-parallel GEMM and g (all-reduce forward, identity backward) after a row-parallel one; Korthikanti
et al. 2022 replace g / f with reduce-scatter / all-gather along the sequence under sequence parallelism.
Activations are [seq, batch, hidden] so that sequence shards are contiguous along dim 0.

Own layers rather than DTensor's parallelize_module: the engine needs every collective to go through
runners.comm (byte counters per link class) and to sit exactly where the cost model prices it, and the
same code must run on gloo, where DTensor's redistribution paths are less complete.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from runners.comm import Comm


@dataclass
class TPContext:
    """Tensor-parallel group of this rank (size 1: every operator is the identity)."""

    group: object
    rank: int
    size: int
    comm: Comm | None
    sequence_parallel: bool = False
    # Test hook (runners/mutations.py, "sp_double_reduce"): how many times a TP-replicated parameter's
    # gradient is all-reduced under sequence parallelism; 1, the correct count, outside tests.
    replicated_grad_reductions: int = 1

    @classmethod
    def single(cls) -> "TPContext":
        return cls(group=None, rank=0, size=1, comm=None, sequence_parallel=False)


def _all_reduce(x: torch.Tensor, tp: TPContext) -> torch.Tensor:
    x = x.contiguous()
    tp.comm.all_reduce(x, tp.group)
    return x


def _gather_seq(x: torch.Tensor, tp: TPContext) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty((x.shape[0] * tp.size, *x.shape[1:]), dtype=x.dtype, device=x.device)
    tp.comm.all_gather(out, x, tp.group)
    return out


def _reduce_scatter_seq(x: torch.Tensor, tp: TPContext) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty((x.shape[0] // tp.size, *x.shape[1:]), dtype=x.dtype, device=x.device)
    tp.comm.reduce_scatter(out, x, tp.group)
    return out


class _CopyToTP(torch.autograd.Function):
    """f: identity forward, all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad.clone(), ctx.tp), None


class _ReduceFromTP(torch.autograd.Function):
    """g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, tp):
        return _all_reduce(x.clone(), tp)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherSeq(torch.autograd.Function):
    """Sequence parallel's f: all-gather along the sequence forward, reduce-scatter backward."""

    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return _gather_seq(x, tp)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_seq(grad, ctx.tp), None


class _ReduceScatterSeq(torch.autograd.Function):
    """Sequence parallel's g: reduce-scatter along the sequence forward, all-gather backward."""

    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return _reduce_scatter_seq(x, tp)

    @staticmethod
    def backward(ctx, grad):
        return _gather_seq(grad, ctx.tp), None


def copy_to_tp(x: torch.Tensor, tp: TPContext) -> torch.Tensor:
    return x if tp.size == 1 else _CopyToTP.apply(x, tp)


def enter_tp_region(x: torch.Tensor, tp: TPContext) -> torch.Tensor:
    """Before a column-parallel GEMM: f, or the sequence all-gather under sequence parallelism."""
    if tp.size == 1:
        return x
    return _GatherSeq.apply(x, tp) if tp.sequence_parallel else _CopyToTP.apply(x, tp)


def exit_tp_region(x: torch.Tensor, tp: TPContext) -> torch.Tensor:
    """After a row-parallel GEMM: g, or the sequence reduce-scatter under sequence parallelism."""
    if tp.size == 1:
        return x
    return _ReduceScatterSeq.apply(x, tp) if tp.sequence_parallel else _ReduceFromTP.apply(x, tp)


def sequence_parallel_param(p: torch.Tensor, tp: TPContext) -> torch.Tensor:
    """A replicated parameter applied to a sequence shard: its gradient is summed over the TP group
    (each rank saw different tokens), which f's backward does."""
    if not tp.sequence_parallel:
        return p
    for _ in range(tp.replicated_grad_reductions):
        p = copy_to_tp(p, tp)
    return p


def tp_shared_param(p: torch.Tensor, tp: TPContext) -> torch.Tensor:
    """A parameter every TP rank holds whole but applies to its own heads (Qwen3's query/key head norms):
    its gradient is summed over the TP group with or without sequence parallelism."""
    return copy_to_tp(p, tp)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Summed cross entropy over logits split along the vocabulary (Megatron's vocab-parallel loss):
    max, sum of exponentials and the target logit are all-reduced, never the logits themselves."""

    @staticmethod
    def forward(ctx, logits, targets, vocab_start, tp):
        logits = logits.float()
        local_max = logits.max(dim=-1).values
        tp.comm.all_reduce(local_max, tp.group, op=dist.ReduceOp.MAX)
        shifted = logits - local_max.unsqueeze(-1)
        in_range = (targets >= vocab_start) & (targets < vocab_start + logits.shape[-1])
        local_idx = torch.where(in_range, targets - vocab_start, torch.zeros_like(targets))
        target_logit = shifted.gather(-1, local_idx.unsqueeze(-1)).squeeze(-1) * in_range
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        both = torch.stack([sum_exp, target_logit])
        tp.comm.all_reduce(both, tp.group)
        sum_exp, target_logit = both[0], both[1]
        ctx.save_for_backward(exp / sum_exp.unsqueeze(-1), local_idx, in_range)
        return (sum_exp.log() - target_logit).sum()

    @staticmethod
    def backward(ctx, grad):
        softmax, local_idx, in_range = ctx.saved_tensors
        g = softmax.clone()
        g.scatter_add_(-1, local_idx.unsqueeze(-1), -in_range.to(g.dtype).unsqueeze(-1))
        return g * grad, None, None, None


def cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor, *, vocab_start: int, tp: TPContext) -> torch.Tensor:
    """Sum of token cross entropies; logits [..., V / tp] hold vocabulary rows vocab_start onwards."""
    if tp.size == 1:
        return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                                 targets.reshape(-1), reduction="sum")
    return _VocabParallelCrossEntropy.apply(logits, targets, vocab_start, tp)
