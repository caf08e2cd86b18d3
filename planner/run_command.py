"""The library side of `planner run`: build the run from flags, launch it, and report measured beside predicted."""

from __future__ import annotations

import os
from dataclasses import dataclass

from specs.errors import PlannerError
from specs.problem import Problem, make_problem
from planner.inputs import PlanFlags, load_plan, plan_from_flags


@dataclass(frozen=True)
class RunRequest:
    model: str = "tiny"
    hardware: str = "cpu"
    global_batch: int = 8
    seq_len: int | None = 64
    precision: str | None = None
    steps: int = 10
    seed: int = 0
    lr: float = 1e-3
    data: str | None = None
    nproc: int = 2
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None
    gpus_per_node: int | None = None
    engine: str = "ours"
    plan_file: str | None = None
    timeout_s: float | None = None  # None: derived from the plan's predicted step time (runners/faults.py)
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    checkpoint_keep: int = 2
    resume: bool = False
    max_restarts: int = 0


def under_torchrun() -> bool:
    """True when this process is already one rank of a torchrun (or scheduler) launch."""
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ
                                                   and "LOCAL_RANK" in os.environ)


def build_run(request: RunRequest, flags: PlanFlags):
    """The RunConfig for a request; raises PlannerError on any bad input before a process starts."""
    from runners.train import RunConfig

    if request.steps < 1:
        raise PlannerError(f"--steps must be at least 1, got {request.steps}")
    if request.nproc < 1 or request.nnodes < 1:
        raise PlannerError(f"--nproc and --nnodes must be at least 1, got {request.nproc} and {request.nnodes}")
    if request.data is not None and not os.path.exists(request.data):
        raise PlannerError(f"data path not found: {request.data}")
    if request.engine not in ("ours", "torch"):
        raise PlannerError(f"--engine must be ours or torch, got {request.engine!r}")
    _check_reliability_flags(request)
    world = int(os.environ["WORLD_SIZE"]) if under_torchrun() else request.nproc * request.nnodes
    per_node = request.gpus_per_node or (int(os.environ.get("LOCAL_WORLD_SIZE", world)) if under_torchrun() else request.nproc)
    problem: Problem = make_problem(model=request.model, hardware=request.hardware, gpus=world,
                                    gpus_per_node=per_node, global_batch=request.global_batch,
                                    seq_len=request.seq_len, precision=request.precision or "fp32")
    if request.plan_file:
        plan = load_plan(request.plan_file, problem)
    else:
        plan = plan_from_flags(flags, problem)
    if request.engine == "torch":
        from runners.torch_engine import torch_strategy

        torch_strategy(plan)  # refuse a plan torch cannot express before any process starts
    try:
        return RunConfig(plan=plan, model=problem.model, job=problem.job, steps=request.steps, seed=request.seed,
                         lr=request.lr, data=request.data, ranks_per_node=per_node, engine=request.engine,
                         hardware=request.hardware, timeout_s=request.timeout_s or run_timeout_s(plan, problem),
                         checkpoint_dir=request.checkpoint_dir, checkpoint_every=request.checkpoint_every,
                         checkpoint_keep=request.checkpoint_keep, resume=request.resume)
    except ValueError as exc:
        raise PlannerError(str(exc)) from None


def _check_reliability_flags(request: RunRequest) -> None:
    """The timeout, checkpoint and restart flags, checked before any process starts."""
    if request.timeout_s is not None and not 0 < request.timeout_s < float("inf"):
        raise PlannerError(f"--timeout must be a positive number of seconds, got {request.timeout_s}")
    if request.checkpoint_every < 0 or request.checkpoint_keep < 1 or request.max_restarts < 0:
        raise PlannerError(f"--checkpoint-every and --max-restarts must be >= 0 and --checkpoint-keep >= 1, got "
                           f"{request.checkpoint_every}, {request.max_restarts} and {request.checkpoint_keep}")
    wants_checkpoints = request.checkpoint_every > 0 or request.resume or request.max_restarts > 0
    if wants_checkpoints and not request.checkpoint_dir:
        raise PlannerError("--checkpoint-every, --resume and --max-restarts need --checkpoint-dir")
    if request.checkpoint_dir is not None:
        if os.path.exists(request.checkpoint_dir) and not os.path.isdir(request.checkpoint_dir):
            raise PlannerError(f"--checkpoint-dir {request.checkpoint_dir} exists and is not a directory")
        if request.engine != "ours":
            raise PlannerError("--checkpoint-dir is implemented for --engine ours only")


def run_timeout_s(plan, problem: Problem) -> float:
    """The collective timeout for a run: from the cost model's step time on the problem's hardware and
    the checkpoint bytes each rank writes (runners.faults.derive_timeout_s)."""
    from cost_models.estimate import estimate
    from runners.faults import checkpoint_bytes_per_rank, derive_timeout_s

    try:
        step_time_s = estimate(plan, model=problem.model, cluster=problem.cluster, job=problem.job).step_time_s
    except (ValueError, ZeroDivisionError):  # a plan the cost model cannot price still runs, with the floor
        step_time_s = 0.0
    return derive_timeout_s(step_time_s=step_time_s, checkpoint_bytes_per_rank=checkpoint_bytes_per_rank(
        num_params=problem.model.num_params(), world_size=plan.world_size))


def run_in_this_process(cfg) -> dict:
    """Under an existing torchrun: this process is one rank; train and return the metrics."""
    import torch.distributed as dist

    from runners.faults import init_distributed
    from runners.train import pick_device, train

    device, backend = pick_device()
    init_distributed(backend, timeout_s=cfg.timeout_s)
    try:
        metrics, _ = train(cfg, device=device)
    finally:
        dist.destroy_process_group()
    return metrics
