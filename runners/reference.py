"""The one-process reference: the same model, data and loss, trained with torch.optim.Adam on one
process with no parallelism. Every parallel plan must reproduce its losses (fp32, within 1e-4), its
first step's gradients and its parameters (tests/distributed/harness.py, test_gradients.py)."""

from __future__ import annotations

import torch

from runners.data import make_data
from runners.transformer import build_chunk
from runners.tensor_parallel import TPContext


def _build(cfg, *, recompute, device: torch.device):
    """The whole model as one chunk on `device` (a tied head shares the embedding's Parameter), its Adam
    and data (TF32 as the config allows it)."""
    from runners.train import set_matmul_precision

    set_matmul_precision(device, allow_tf32=cfg.allow_tf32)
    spec, job = cfg.model, cfg.job
    torch.manual_seed(cfg.seed)
    chunk = build_chunk(spec, layers=range(spec.num_layers), first=True, last=True, seed=cfg.seed,
                        tp=TPContext.single(), recompute=recompute, loss_scale=1.0 / (job.global_batch * job.seq_len),
                        share_tied=True, aux_scale=1.0 / job.global_batch).to(device)
    optimizer = torch.optim.Adam(chunk.parameters(), lr=cfg.lr, betas=(0.9, 0.999), eps=1e-8)
    data = make_data(cfg.data, vocab_size=spec.vocab_size, seq_len=job.seq_len, seed=cfg.seed)
    return chunk, optimizer, data


def _named(chunk, pick) -> dict[str, torch.Tensor]:
    """One tensor per canonical name (a tied weight once), on CPU."""
    out: dict[str, torch.Tensor] = {}
    for p in chunk.parameters():
        out.setdefault(p.canonical_name, pick(p).detach().cpu().clone())
    return out


def train_reference(cfg, *, device: torch.device | None = None) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Losses per step and the final parameters (on CPU) by canonical name, for a runners.train.RunConfig,
    trained on `device` (default CPU)."""
    device = device or torch.device("cpu")
    plan = cfg.plan
    recompute = list(plan.recompute_layers) if plan.recompute_layers is not None else plan.recompute
    chunk, optimizer, data = _build(cfg, recompute=recompute, device=device)
    losses = []
    for step in range(cfg.steps):
        sequences = data.global_batch(step, cfg.job.global_batch).to(device)
        loss = chunk(sequences[:, :-1], sequences[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, _named(chunk, lambda p: p)


def initial_parameters(cfg) -> dict[str, torch.Tensor]:
    """The parameters every run of `cfg` starts from, by canonical name."""
    chunk, _, _ = _build(cfg, recompute="none", device=torch.device("cpu"))
    return _named(chunk, lambda p: p)


def first_step_reference(cfg) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(initial parameters, first step's gradients, parameters after the first update) by canonical
    name, on CPU: the whole global batch of step 0 in one forward and backward, no recomputation."""
    chunk, optimizer, data = _build(cfg, recompute="none", device=torch.device("cpu"))
    before = _named(chunk, lambda p: p)
    sequences = data.global_batch(0, cfg.job.global_batch)
    chunk(sequences[:, :-1], sequences[:, 1:]).backward()
    grads = _named(chunk, lambda p: p.grad)
    optimizer.step()
    return before, grads, _named(chunk, lambda p: p)
