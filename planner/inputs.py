"""Build the four inputs (model, cluster, job, plan) from command-line values and plan files; shared by
every command."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from specs.errors import PlannerError
from specs.knobs import cli_value
from specs.plan import PLAN_KNOBS, Plan, check_plan, micro_batches_for, zero_degrees
from specs.planfile import PlanFile, hardware_source, read_plan_json
from specs.problem import Problem, make_problem


@dataclass(frozen=True)
class ProblemFlags:
    """The problem options a command was given (None: not given)."""

    model: str | None = None
    hardware: str | None = None
    gpus: int | None = None
    gpus_per_node: int | None = None
    global_batch: int | None = None
    seq_len: int | None = None
    precision: str | None = None
    memory_headroom: float | None = None

    def given(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}


_FLAG = {"model": "--model", "hardware": "--hardware", "gpus": "--gpus", "gpus_per_node": "--gpus-per-node",
         "global_batch": "--global-batch", "seq_len": "--seq-len", "precision": "--precision",
         "memory_headroom": "--memory-headroom"}


def problem_from_flags(flags: ProblemFlags) -> Problem:
    """The problem the flags describe; model, devices and global batch are required, the hardware defaults
    to this machine's profile for that many processes (planner/machine.py)."""
    from planner.machine import local_hardware

    for name in ("model", "gpus", "global_batch"):
        if getattr(flags, name) is None:
            raise PlannerError(f"{_FLAG[name]} is required (or --plan with a plan file from `planner search --out`)")
    hardware = flags.hardware or local_hardware(flags.gpus)
    return make_problem(model=flags.model, hardware=hardware, gpus=flags.gpus, gpus_per_node=flags.gpus_per_node,
                        global_batch=flags.global_batch, seq_len=flags.seq_len, precision=flags.precision,
                        memory_headroom=flags.memory_headroom)


def plan_and_problem(path: str, flags: ProblemFlags) -> tuple[Plan, Problem, PlanFile | None]:
    """The plan of `path` and the problem around it.

    A plan file carries its problem: flags may repeat it, and one that contradicts it is an error (never a
    silent repricing). A bare plan needs --model and --hardware; the devices and global batch default to
    the plan's own."""
    loaded = read_plan_json(path)
    if isinstance(loaded, PlanFile):
        check_flags_agree(loaded, flags, path=path)
        return loaded.plan, Problem(model=loaded.model, cluster=loaded.cluster, job=loaded.job), loaded
    plan = loaded
    for name in ("model", "hardware"):
        if getattr(flags, name) is None:
            raise PlannerError(f"{path} holds a bare plan: give {_FLAG[name]} (a plan file from `planner search --out` "
                               f"carries the model, hardware, cluster and job)")
    problem = make_problem(model=flags.model, hardware=flags.hardware, gpus=flags.gpus or plan.world_size,
                           gpus_per_node=flags.gpus_per_node, global_batch=flags.global_batch or plan.global_batch,
                           seq_len=flags.seq_len, precision=flags.precision, memory_headroom=flags.memory_headroom)
    check_plan(plan, model=problem.model, num_devices=problem.cluster.num_devices, job=problem.job)
    return plan, problem, None


def check_flags_agree(planfile: PlanFile, flags: ProblemFlags, *, path: str) -> None:
    """Raise PlannerError naming the first given flag that differs from what the plan file was made for."""
    from specs.hardware import resolve_hardware
    from specs.model import resolve_model

    job, cluster = planfile.job, planfile.cluster
    theirs = {"gpus": cluster.num_devices, "gpus_per_node": cluster.devices_per_node,
              "global_batch": job.global_batch, "seq_len": job.seq_len, "precision": job.precision,
              "memory_headroom": job.headroom(cluster.hardware.device_type)}
    for name, value in flags.given().items():
        if name == "model":
            spec = resolve_model(value)
            same = dataclasses.replace(spec, name="") == dataclasses.replace(planfile.model, name="")
            mine_text, file_text = value, planfile.model.name
        elif name == "hardware":
            same = resolve_hardware(value).to_dict() == planfile.hardware.to_dict()
            mine_text, file_text = hardware_source(value).describe(), planfile.hardware_source.describe()
        else:
            same, mine_text, file_text = value == theirs[name], value, theirs[name]
        if not same:
            raise PlannerError(f"{_FLAG[name]} {mine_text} contradicts the plan file {path}, made for {file_text}; "
                               f"drop the flag, or search again for this problem")


def refuse_plan_options_with_file(options: dict[str, Any]) -> None:
    """Plan options (--tp, --zero, ...) cannot be combined with --plan: the file holds the plan."""
    given = [name for name, value in options.items() if value is not None]
    if given:
        flag = "--zero" if given[0] == "zero" else next(s.flag for s in PLAN_KNOBS if s.name == given[0])
        raise PlannerError(f"{flag} cannot be combined with --plan (the file holds the plan); give one or the other")


def plan_from_options(options: dict[str, Any], problem: Problem) -> Plan:
    """The plan that command-line plan options describe (one value per plan knob, None: not given, and
    the --zero shorthand); dp defaults to what the other degrees leave of the cluster, the micro-batch
    count to what the global batch leaves, the schedule to interleaved-1f1b with virtual stages."""
    values = {k: v for k, v in options.items() if v is not None}
    zero = values.pop("zero", None)
    unknown = sorted(set(values) - {spec.name for spec in PLAN_KNOBS})
    if unknown:
        raise PlannerError(f"unknown plan option {unknown[0]!r}")
    for spec in PLAN_KNOBS:
        if spec.name in values:
            values[spec.name] = cli_value(spec, values[spec.name])
    n = problem.cluster.num_devices
    tp, pp, cp = values.setdefault("tp", 1), values.setdefault("pp", 1), values.setdefault("cp", 1)
    if tp < 1 or pp < 1 or cp < 1:
        raise PlannerError(f"--tp, --pp and --cp must be at least 1, got tp={tp}, pp={pp}, cp={cp}")
    if "dp" not in values and n % (tp * pp * cp):
        raise PlannerError(f"cp x tp x pp = {cp * tp * pp} does not divide the {n} devices")
    dp = values.setdefault("dp", n // (tp * pp * cp))
    if dp * cp * tp * pp != n:  # before the batch arithmetic, whose message would hide the real mismatch
        names, values = ("dp", "cp", "tp", "pp"), (dp, cp, tp, pp)
        if cp == 1:
            names, values = ("dp", "tp", "pp"), (dp, tp, pp)
        raise PlannerError(f"{' x '.join(names)} = {' x '.join(map(str, values))} = {dp * cp * tp * pp}, but the "
                           f"cluster has {n} devices")
    micro_batch = values.setdefault("micro_batch", 1)
    if dp < 1 or micro_batch < 1:
        raise PlannerError(f"--dp and --micro-batch must be at least 1, got dp={dp}, micro_batch={micro_batch}")
    shard_names = ("param_shard", "grad_shard", "optim_shard")
    if zero is not None:
        if any(name in values for name in shard_names):
            raise PlannerError("give either --zero or --param-shard/--grad-shard/--optim-shard, not both")
        values.update(zip(shard_names, zero_degrees(zero, dp * cp)))  # CP ranks reduce with DP's
    values.setdefault("schedule", "interleaved-1f1b" if values.get("virtual_stages", 1) > 1 else "1f1b")
    values.setdefault("num_micro_batches", micro_batches_for(global_batch=problem.job.global_batch, dp=dp,
                                                             micro_batch=micro_batch))
    try:
        plan = Plan(**values)
    except ValueError as exc:
        raise PlannerError(f"plan: {exc}") from None
    check_plan(plan, model=problem.model, num_devices=n, job=problem.job)
    return plan


def load_plan(path: str, problem: Problem | None = None) -> Plan:
    """The plan of a plan file or bare plan JSON (specs.planfile.read_plan_json), checked against `problem`."""
    loaded = read_plan_json(path)
    plan = loaded.plan if isinstance(loaded, PlanFile) else loaded
    if problem is not None:
        check_plan(plan, model=problem.model, num_devices=problem.cluster.num_devices, job=problem.job)
    return plan
