"""Run a plan on N local gloo processes (torch.multiprocessing) and compare with the one-process reference."""

from __future__ import annotations

import os
import socket
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from specs.job import Job
from specs.model import PRESETS
from specs.plan import Plan
from runners.config import RunConfig

LOSS_TOL = 1e-4
PARAM_TOL = 1e-3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_config(plan: Plan, *, steps: int = 8, seq_len: int = 32, lr: float = 3e-3, ranks_per_node: int = 0,
                engine: str = "ours", model: str = "tiny", seed: int = 1234, **model_changes) -> RunConfig:
    import dataclasses

    spec = dataclasses.replace(PRESETS[model], **model_changes) if model_changes else PRESETS[model]
    return RunConfig(plan=plan, model=spec, job=Job(global_batch=plan.global_batch, seq_len=seq_len, precision="fp32"),
                     steps=steps, seed=seed, lr=lr, ranks_per_node=ranks_per_node, engine=engine, timeout_s=120)


def _worker(rank: int, world: int, port: int, cfgs: list[RunConfig], queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    try:
        import datetime

        from runners.train import train

        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
        for cfg in cfgs:  # one process group for several plans: start-up dominates tiny runs
            metrics, trainer = train(cfg, device=torch.device("cpu"))
            params = trainer.full_parameters()
            if rank == 0:
                # numpy, not tensors: torch would pass shared-memory handles that die with this process.
                queue.put(("ok", metrics, {k: v.numpy() for k, v in params.items()}))
        dist.destroy_process_group()
    except Exception:
        queue.put(("error", f"rank {rank}: {traceback.format_exc()}", None))
        raise


def run_plans(cfgs: list[RunConfig]) -> list[tuple[dict, dict[str, torch.Tensor]]]:
    """Train each config in turn on one set of world_size local processes; rank 0's metrics and the
    full parameters of each."""
    world = cfgs[0].plan.world_size
    assert all(c.plan.world_size == world for c in cfgs)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, cfgs, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = []
    try:
        for _ in cfgs:
            status, metrics, params = queue.get(timeout=600)
            if status != "ok":
                raise AssertionError(metrics)
            results.append((metrics, {k: torch.from_numpy(v) for k, v in params.items()}))
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    return results


def cached_matrix_results(matrix: dict[int, dict], config_fn):
    """A function (world, name) -> (metrics, params) for a test matrix {world size: {name: ...}}: the first
    request for a world size trains all that size's plans, config_fn(world, name) each, on one set of
    processes (start-up dominates these tiny runs); later requests read the cached result."""
    by_world: dict[int, dict] = {}

    def result(world: int, name: str) -> tuple[dict, dict[str, torch.Tensor]]:
        if world not in by_world:
            names = list(matrix[world])
            by_world[world] = dict(zip(names, run_plans([config_fn(world, n) for n in names])))
        return by_world[world][name]

    return result


def run_plan(cfg: RunConfig) -> tuple[dict, dict[str, torch.Tensor]]:
    return run_plans([cfg])[0]


def check_against_reference(cfg: RunConfig, metrics, params: dict[str, torch.Tensor], *,
                            check_params: bool = True) -> None:
    """Losses within 1e-4 and parameters within 1e-3 of the one-process reference."""
    from runners.reference import train_reference

    ref_losses, ref_params = train_reference(cfg)
    losses = metrics.losses
    assert len(losses) == len(ref_losses) == cfg.steps
    worst = max(abs(a - b) for a, b in zip(losses, ref_losses))
    assert worst <= LOSS_TOL, f"{cfg.plan.describe()}: loss differs by {worst:.2e}\n ours {losses}\n ref  {ref_losses}"
    if check_params:
        assert set(params) == set(ref_params), set(params) ^ set(ref_params)
        for name, ref in ref_params.items():
            diff = (params[name] - ref).abs().max().item()
            assert diff <= PARAM_TOL, f"{cfg.plan.describe()}: parameter {name} differs by {diff:.2e}"


def assert_matches_reference(cfg: RunConfig, *, check_params: bool = True) -> dict:
    metrics, params = run_plan(cfg)
    check_against_reference(cfg, metrics, params, check_params=check_params)
    return metrics
