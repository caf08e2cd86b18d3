"""The library side of `planner run`: build the run from flags, launch it, and report measured beside predicted."""

from __future__ import annotations

import dataclasses
import os
import warnings
from dataclasses import dataclass

from specs.errors import PlannerError
from specs.planfile import PlanFile, read_plan_json
from specs.problem import Problem, make_problem
from planner.machine import default_nproc, local_hardware, local_precision
from planner.inputs import ProblemFlags, check_flags_agree, load_plan, plan_from_options, refuse_plan_options_with_file

# What `planner run` trains when neither a flag nor a plan file says otherwise.
# The hardware, precision and process count are this machine's (planner/machine.py).
RUN_DEFAULTS = {"model": "tiny", "global_batch": 8, "seq_len": 64, "nnodes": 1}


@dataclass(frozen=True)
class RunRequest:
    """The options of `planner run`; None: not given (resolve_request fills them from the plan file or
    RUN_DEFAULTS, and the hardware and precision from this machine)."""

    model: str | None = "tiny"
    hardware: str | None = None  # None: this machine's profile (planner.machine.local_hardware)
    global_batch: int | None = 8
    seq_len: int | None = 64
    precision: str | None = None
    steps: int = 10
    seed: int = 0
    lr: float = 1e-3
    data: str | None = None
    nproc: int | None = None  # None: planner.machine.default_nproc()
    nnodes: int | None = 1
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
    cluster: str | None = None  # the emulated cluster's name prefix: one torchrun per node namespace
    elastic: str | None = None  # MIN:MAX nodes (runners/elastic.py, planner/elastic.py)
    mtbf_s: float | None = None  # the job's mean time between failures: checkpoint every Daly's interval

    def where(self):
        """Where the run's processes go (runners.launch.Where; it checks the counts)."""
        from runners.elastic import parse_node_range
        from runners.launch import Where

        try:
            nodes = parse_node_range(self.elastic) if self.elastic else None
        except ValueError as exc:
            raise PlannerError(str(exc)) from None
        return Where(nproc=self.nproc, nnodes=self.nnodes, node_rank=self.node_rank, rdzv_endpoint=self.rdzv_endpoint,
                     max_restarts=self.max_restarts, cluster=self.cluster, elastic=nodes)


def under_torchrun() -> bool:
    """True when this process is already one rank of a torchrun (or scheduler) launch."""
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ
                                                   and "LOCAL_RANK" in os.environ)


def resolve_request(request: RunRequest, plan_options: dict) -> tuple[RunRequest, PlanFile | None]:
    """The request with every option that was not given filled in: from the plan file when --plan is one
    (`search --out`; a given flag must agree with it, and plan options cannot be combined with it), else
    from RUN_DEFAULTS. With a plan file the processes default to all its devices on --nnodes nodes, grouped
    into nodes as the file says."""
    planfile = read_plan_json(request.plan_file) if request.plan_file else None
    if not isinstance(planfile, PlanFile):
        filled = {k: v for k, v in {**RUN_DEFAULTS, "nproc": default_nproc()}.items() if getattr(request, k) is None}
        return dataclasses.replace(request, **filled), None
    refuse_plan_options_with_file(plan_options)
    check_flags_agree(planfile, ProblemFlags(model=request.model, hardware=request.hardware,
                                             gpus_per_node=request.gpus_per_node, global_batch=request.global_batch,
                                             seq_len=request.seq_len, precision=request.precision),
                      path=request.plan_file)
    devices, nodes = planfile.cluster.num_devices, planfile.cluster.num_nodes
    if request.nproc is None and request.nnodes is None and nodes > 1:
        # Starting every rank of a multi-node plan here, or waiting for nodes nobody starts, is never meant.
        raise PlannerError(f"the plan file {request.plan_file} is for {nodes} nodes of {planfile.cluster.devices_per_node}"
                           f": give --nnodes {nodes} with --node-rank and --rdzv-endpoint on each node, or --nproc "
                           f"{devices} to run every rank on this host")
    nnodes = 1 if request.nnodes is None else request.nnodes
    if nnodes < 1 or devices % nnodes:
        raise PlannerError(f"--nnodes {nnodes} does not divide the plan file's {devices} devices")
    nproc = devices // nnodes if request.nproc is None else request.nproc
    if nproc * nnodes != devices:
        raise PlannerError(f"--nproc x --nnodes = {nproc} x {nnodes} = {nproc * nnodes}, but the plan "
                           f"file {request.plan_file} is for {devices} devices")
    return dataclasses.replace(request, nproc=nproc, nnodes=nnodes,
                               gpus_per_node=planfile.cluster.devices_per_node), planfile


def build_run(request: RunRequest, plan_options: dict, *, planfile: PlanFile | None = None):
    """The RunConfig for a resolved request (resolve_request; the plan from its file or the plan options,
    the cost model's prediction handed in); raises PlannerError on any bad input before a process starts.
    RunConfig checks its own fields; what is checked here is what it cannot see (files, the launch, flags
    that need others). With --mtbf the checkpoint interval is Daly's for the plan (cost_models/checkpoint.py)."""
    if request.mtbf_s is not None:
        if not 0 < request.mtbf_s < float("inf"):
            raise PlannerError(f"--mtbf must be a positive number of seconds, got {request.mtbf_s}")
        if request.checkpoint_every:
            raise PlannerError("--mtbf sets the checkpoint interval: give --mtbf or --checkpoint-every, not both")
        if not request.checkpoint_dir:
            raise PlannerError("--mtbf needs --checkpoint-dir")
    return _build_run(request, plan_options, planfile=planfile)


def _build_run(request: RunRequest, plan_options: dict, *, planfile: PlanFile | None = None):
    where = request.where()
    if request.data is not None and not os.path.exists(request.data):
        raise PlannerError(f"data path not found: {request.data}")
    if request.max_restarts < 0:
        raise PlannerError(f"--max-restarts must be at least 0, got {request.max_restarts}")
    if (request.checkpoint_every > 0 or request.resume or request.max_restarts > 0) and not request.checkpoint_dir:
        raise PlannerError("--checkpoint-every, --resume and --max-restarts need --checkpoint-dir")
    if request.checkpoint_dir and os.path.exists(request.checkpoint_dir) and not os.path.isdir(request.checkpoint_dir):
        raise PlannerError(f"--checkpoint-dir {request.checkpoint_dir} exists and is not a directory")
    world, per_node = (int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))) \
        if under_torchrun() else where.topology()
    if planfile is not None:
        problem = Problem(model=planfile.model, cluster=planfile.cluster, job=planfile.job)
        if world != problem.cluster.num_devices:
            raise PlannerError(f"this launch has {world} processes, but the plan file {request.plan_file} is for "
                               f"{problem.cluster.num_devices} devices")
    else:
        problem = make_problem(model=request.model, hardware=request.hardware or local_hardware(world, measure=not under_torchrun()),
                               gpus=world, gpus_per_node=request.gpus_per_node or per_node,
                               global_batch=request.global_batch, seq_len=request.seq_len,
                               precision=request.precision or local_precision())
    _warn_if_profile_mismatch(problem)
    if where.elastic is not None:
        return _elastic_run(request, plan_options, problem=problem, where=where, world=world, per_node=per_node)
    if planfile is not None:
        plan = planfile.plan
    elif request.plan_file:
        refuse_plan_options_with_file(plan_options)
        plan = load_plan(request.plan_file, problem)
    else:
        plan = plan_from_options(plan_options, problem)
    if request.engine == "torch":
        from runners.torch_engine import torch_strategy

        torch_strategy(plan)  # refuse a plan torch cannot express before any process starts
        if problem.job.precision == "fp16":
            raise PlannerError("--engine torch has no loss scaling, so fp16 gradients would underflow; "
                               "use --precision bf16, or --engine ours (dynamic loss scaling)")
    predicted = predict(plan, problem)
    return _run_config(request, plan=plan, problem=problem, per_node=per_node, predicted=predicted)


def _run_config(request: RunRequest, *, plan, problem: Problem, per_node: int, predicted, **extra):
    from runners.config import RunConfig

    checkpoint_every = request.checkpoint_every
    if request.mtbf_s is not None:
        from cost_models.checkpoint import plan_cadence

        checkpoint_every = plan_cadence(model=problem.model, cluster=problem.cluster, mtbf_s=request.mtbf_s,
                                        step_time_s=predicted.step_time_s if predicted is not None else 0.0).every_steps
    try:
        return RunConfig(plan=plan, model=problem.model, job=problem.job, steps=request.steps, seed=request.seed,
                         lr=request.lr, data=request.data, ranks_per_node=request.gpus_per_node or per_node,
                         engine=request.engine, predicted=predicted.to_dict() if predicted is not None else None,
                         timeout_s=request.timeout_s if request.timeout_s is not None else run_timeout_s(
                             predicted.step_time_s if predicted is not None else None, plan, problem),
                         checkpoint_dir=request.checkpoint_dir, checkpoint_every=checkpoint_every,
                         checkpoint_keep=request.checkpoint_keep, resume=request.resume, **extra)
    except ValueError as exc:
        raise PlannerError(str(exc)) from None


def _elastic_run(request: RunRequest, plan_options: dict, *, problem: Problem, where, world: int, per_node: int):
    """The RunConfig of an elastic run: the searched plan of every world size it may have
    (planner/elastic.py), starting with the one for `world`."""
    from specs.cluster import make_cluster
    from planner.elastic import plan_table

    if request.plan_file or any(v is not None for v in plan_options.values()):
        raise PlannerError("--elastic searches the plan of every world size itself; give no plan options or --plan")
    if request.engine != "ours":
        raise PlannerError("--elastic needs --engine ours (checkpoints that resume under another plan)")

    def problem_for(num_devices: int) -> Problem:
        cluster = make_cluster(hardware=problem.cluster.hardware, num_devices=num_devices, devices_per_node=per_node)
        return Problem(model=problem.model, cluster=cluster, job=problem.job)

    table = plan_table(problem_for, nodes=where.elastic, procs_per_node=per_node, engine=request.engine)
    start = table.plan_for(world)
    # One timeout for every world: the run's collectives must wait as long as its slowest world needs.
    timeout_s = request.timeout_s if request.timeout_s is not None else max(
        run_timeout_s(e.predicted["step_time_s"], e.plan, problem_for(e.world_size)) for e in table.entries)
    return _run_config(dataclasses.replace(request, timeout_s=timeout_s), plan=start.plan, problem=problem,
                       per_node=per_node, predicted=table.estimates[world], elastic_plans=table.entries)


def _warn_if_profile_mismatch(problem: Problem) -> None:
    import torch

    mismatch = problem.cluster.hardware.mismatch(device_type="cuda" if torch.cuda.is_available() else "cpu")
    if mismatch:
        warnings.warn(mismatch, stacklevel=3)


def predict(plan, problem: Problem):
    """The cost model's Estimate of `plan` on the problem's hardware, or None for a plan it cannot price
    (which still runs)."""
    from cost_models.estimate import estimate

    try:
        return estimate(plan, model=problem.model, cluster=problem.cluster, job=problem.job)
    except (ValueError, ZeroDivisionError):
        return None


def run_timeout_s(step_time_s: float | None, plan, problem: Problem) -> float:
    """The collective timeout for a run: from the predicted step time (None: the floor) and the
    checkpoint bytes each rank writes (runners.faults.derive_timeout_s)."""
    from runners.faults import checkpoint_bytes_per_rank, derive_timeout_s

    return derive_timeout_s(step_time_s=step_time_s or 0.0, checkpoint_bytes_per_rank=checkpoint_bytes_per_rank(
        num_params=problem.model.num_params(), world_size=plan.world_size))


def run_in_this_process(cfg) -> dict:
    """Under an existing torchrun: this process is one rank; train and return the metrics."""
    import torch.distributed as dist

    from runners.faults import init_distributed
    from runners.launch import pick_device
    from runners.train import train

    device, backend = pick_device()
    init_distributed(backend, timeout_s=cfg.timeout_s)
    try:
        metrics, _ = train(cfg, device=device)
    finally:
        dist.destroy_process_group()
    return metrics
