"""The library side of `planner run`: build the run from flags, launch it, and report measured beside predicted."""

from __future__ import annotations

import dataclasses
import os
import warnings
from dataclasses import dataclass

from specs.errors import PlannerError
from specs.planfile import PlanFile, read_plan_json
from specs.problem import Problem, make_problem
from planner.inputs import ProblemFlags, check_flags_agree, load_plan, plan_from_options, refuse_plan_options_with_file

# What `planner run` trains when neither a flag nor a plan file says otherwise.
# The hardware and precision are this machine's (local_hardware, local_precision).
RUN_DEFAULTS = {"model": "tiny", "global_batch": 8, "seq_len": 64, "nproc": 2, "nnodes": 1}


def local_hardware() -> str:
    """The hardware this machine's runs are priced on by default: its GPU's preset (matched by name),
    else cpu. A GPU without a preset is priced as an h100, with a warning (profile it instead)."""
    import torch

    from specs.hardware import preset_for_device

    if not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name(0)
    preset = preset_for_device(name)
    if preset is not None:
        return preset.name
    warnings.warn(f"no hardware preset for {name}: pricing with h100's datasheet; `planner profile` measures it",
                  stacklevel=2)
    return "h100"


def local_precision() -> str:
    """The compute precision of a run on this machine by default: bf16 on a GPU that has it (with fp32
    master weights), fp32 on CPU (where bf16 is emulated on most cores)."""
    import torch

    return "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "fp32"


@dataclass(frozen=True)
class RunRequest:
    """The options of `planner run`; None: not given (resolve_request fills them from the plan file or
    RUN_DEFAULTS, and the hardware and precision from this machine)."""

    model: str | None = "tiny"
    hardware: str | None = None  # None: local_hardware()
    global_batch: int | None = 8
    seq_len: int | None = 64
    precision: str | None = None
    steps: int = 10
    seed: int = 0
    lr: float = 1e-3
    data: str | None = None
    nproc: int | None = 2
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

    def where(self):
        """Where the run's processes go (runners.launch.Where; it checks the counts)."""
        from runners.launch import Where

        return Where(nproc=self.nproc, nnodes=self.nnodes, node_rank=self.node_rank, rdzv_endpoint=self.rdzv_endpoint,
                     max_restarts=self.max_restarts)


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
        filled = {k: v for k, v in RUN_DEFAULTS.items() if getattr(request, k) is None}
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
    that need others)."""
    from runners.config import RunConfig

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
        problem = make_problem(model=request.model, hardware=request.hardware or local_hardware(), gpus=world,
                               gpus_per_node=request.gpus_per_node or per_node, global_batch=request.global_batch,
                               seq_len=request.seq_len, precision=request.precision or local_precision())
    _warn_if_profile_mismatch(problem)
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
    try:
        return RunConfig(plan=plan, model=problem.model, job=problem.job, steps=request.steps, seed=request.seed,
                         lr=request.lr, data=request.data, ranks_per_node=request.gpus_per_node or per_node,
                         engine=request.engine, predicted=predicted.to_dict() if predicted is not None else None,
                         timeout_s=request.timeout_s if request.timeout_s is not None else run_timeout_s(predicted, plan, problem),
                         checkpoint_dir=request.checkpoint_dir, checkpoint_every=request.checkpoint_every,
                         checkpoint_keep=request.checkpoint_keep, resume=request.resume)
    except ValueError as exc:
        raise PlannerError(str(exc)) from None


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


def run_timeout_s(predicted, plan, problem: Problem) -> float:
    """The collective timeout for a run: from the predicted step time (None: the floor) and the
    checkpoint bytes each rank writes (runners.faults.derive_timeout_s)."""
    from runners.faults import checkpoint_bytes_per_rank, derive_timeout_s

    step_time_s = predicted.step_time_s if predicted is not None else 0.0
    return derive_timeout_s(step_time_s=step_time_s, checkpoint_bytes_per_rank=checkpoint_bytes_per_rank(
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
