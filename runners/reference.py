"""The one-process reference: the same model, data and loss, trained with torch.optim.Adam on one
process with no parallelism. Every parallel plan must reproduce its losses (fp32, within 1e-4)."""

from __future__ import annotations

import torch

from runners.data import make_data
from runners.transformer import build_chunk
from runners.tensor_parallel import TPContext


def train_reference(cfg, *, device: torch.device | None = None) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Losses per step and the final parameters (on CPU) by canonical name, for a runners.train.RunConfig,
    trained on `device` (default CPU; TF32 as the config allows it)."""
    from runners.train import set_matmul_precision

    device = device or torch.device("cpu")
    set_matmul_precision(device, allow_tf32=cfg.allow_tf32)
    spec, job, plan = cfg.model, cfg.job, cfg.plan
    torch.manual_seed(cfg.seed)
    recompute = list(plan.recompute_layers) if plan.recompute_layers is not None else plan.recompute
    chunk = build_chunk(spec, layers=range(spec.num_layers), first=True, last=True, seed=cfg.seed,
                        tp=TPContext.single(), recompute=recompute, loss_scale=1.0 / (job.global_batch * job.seq_len),
                        share_tied=True).to(device)
    optimizer = torch.optim.Adam(chunk.parameters(), lr=cfg.lr, betas=(0.9, 0.999), eps=1e-8)
    data = make_data(cfg.data, vocab_size=spec.vocab_size, seq_len=job.seq_len, seed=cfg.seed)
    losses = []
    for step in range(cfg.steps):
        sequences = data.global_batch(step, job.global_batch).to(device)
        loss = chunk(sequences[:, :-1], sequences[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    params: dict[str, torch.Tensor] = {}
    for p in chunk.parameters():
        params.setdefault(p.canonical_name, p.detach().cpu().clone())
    return losses, params
