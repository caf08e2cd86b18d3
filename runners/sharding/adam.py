"""The optimizer of the sharded engine: torch.optim.Adam's single-tensor arithmetic on a unit's fp32
optimizer shard (runners/sharding/layout.FlatUnit), then the compute-dtype parameter slice refreshed."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AdamSettings:
    lr: float
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0  # L2 added to the gradient, as torch.optim.Adam does


@torch.no_grad()
def adam_update(u, *, step: int, settings: AdamSettings, grad_scale: float = 1.0) -> None:
    """One Adam step (number `step`, from 1) of unit `u`'s shard from its reduced gradient times
    `grad_scale` (1 / the loss scale under fp16, applied in fp32)."""
    beta1, beta2 = settings.betas
    grad = u.optim_grad()
    if grad_scale != 1.0:
        grad = grad * grad_scale
    if settings.weight_decay != 0:
        grad = grad.add(u.master, alpha=settings.weight_decay)
    u.exp_avg.lerp_(grad, 1 - beta1)
    u.exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bias_correction1 = 1 - beta1 ** step
    bias_correction2 = 1 - beta2 ** step
    step_size = settings.lr / bias_correction1
    denom = (u.exp_avg_sq.sqrt() / bias_correction2 ** 0.5).add_(settings.eps)
    u.master.addcdiv_(u.exp_avg, denom, value=-step_size)
    if u.master is not u.param_slice:
        u.param_slice.copy_(u.master)
