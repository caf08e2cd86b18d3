"""Run a plan on N local gloo processes (torch.multiprocessing) and compare with the one-process reference."""

from __future__ import annotations

import os
import socket
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from planner.job import Job
from planner.model import PRESETS
from planner.plan import Plan
from runners.train import RunConfig

LOSS_TOL = 1e-4
PARAM_TOL = 1e-3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_config(plan: Plan, *, steps: int = 8, seq_len: int = 32, lr: float = 3e-3, ranks_per_node: int = 0,
                engine: str = "ours", model: str = "tiny", **model_changes) -> RunConfig:
    import dataclasses

    spec = dataclasses.replace(PRESETS[model], **model_changes) if model_changes else PRESETS[model]
    return RunConfig(plan=plan, model=spec, job=Job(global_batch=plan.global_batch, seq_len=seq_len, precision="fp32"),
                     steps=steps, seed=1234, lr=lr, ranks_per_node=ranks_per_node, engine=engine, timeout_s=120)


def _worker(rank: int, world: int, port: int, cfg: RunConfig, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    try:
        import datetime

        from runners.train import train

        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
        metrics, trainer = train(cfg, device=torch.device("cpu"))
        params = trainer.full_parameters()
        if rank == 0:
            queue.put(("ok", metrics, params))
        dist.destroy_process_group()
    except Exception:
        queue.put(("error", f"rank {rank}: {traceback.format_exc()}", None))
        raise


def run_plan(cfg: RunConfig) -> tuple[dict, dict[str, torch.Tensor]]:
    """Train `cfg` on plan.world_size local processes; returns rank 0's metrics and the full parameters."""
    world = cfg.plan.world_size
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, cfg, queue)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        status, metrics, params = queue.get(timeout=300)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    if status != "ok":
        raise AssertionError(metrics)
    return metrics, params


def assert_matches_reference(cfg: RunConfig, *, check_params: bool = True) -> dict:
    """Run the plan and the one-process reference; losses within 1e-4, parameters within 1e-3."""
    from runners.reference import train_reference

    metrics, params = run_plan(cfg)
    ref_losses, ref_params = train_reference(cfg)
    losses = [s["loss"] for s in metrics["steps"]]
    assert len(losses) == len(ref_losses) >= 8 or len(losses) == cfg.steps
    worst = max(abs(a - b) for a, b in zip(losses, ref_losses))
    assert worst <= LOSS_TOL, f"{cfg.plan.describe()}: loss differs by {worst:.2e}\n ours {losses}\n ref  {ref_losses}"
    if check_params:
        assert set(params) == set(ref_params), set(params) ^ set(ref_params)
        for name, ref in ref_params.items():
            diff = (params[name] - ref).abs().max().item()
            assert diff <= PARAM_TOL, f"{cfg.plan.describe()}: parameter {name} differs by {diff:.2e}"
    return metrics
