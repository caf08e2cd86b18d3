"""Build the four inputs (model, cluster, job, plan) from command-line values; shared by every command."""

from __future__ import annotations

from dataclasses import dataclass

from specs.errors import PlannerError
from specs.jsonio import read_json_file
from specs.plan import Plan, check_plan, micro_batches_for, zero_degrees
from specs.problem import Problem


@dataclass(frozen=True)
class PlanFlags:
    """Plan flags as typed on the command line; None means "not given"."""

    dp: int | None = None
    tp: int = 1
    pp: int = 1
    virtual_stages: int = 1
    micro_batch: int = 1
    schedule: str | None = None
    recompute: str = "none"
    sequence_parallel: bool = False
    zero: int | None = None
    param_shard: int | None = None
    grad_shard: int | None = None
    optim_shard: int | None = None
    prefetch_depth: int = 1
    bucket_size_mb: float | None = None
    param_cache: str = "none"
    commshift: bool = False


def plan_from_flags(flags: PlanFlags, problem: Problem) -> Plan:
    """The plan the flags describe; dp defaults to what the other degrees leave of the cluster."""
    n = problem.cluster.num_devices
    if flags.tp < 1 or flags.pp < 1:
        raise PlannerError(f"--tp and --pp must be at least 1, got tp={flags.tp}, pp={flags.pp}")
    if flags.dp is None and n % (flags.tp * flags.pp):
        raise PlannerError(f"tp x pp = {flags.tp * flags.pp} does not divide the {n} devices")
    dp = flags.dp if flags.dp is not None else n // (flags.tp * flags.pp)
    if dp < 1 or flags.micro_batch < 1:
        raise PlannerError(f"--dp and --micro-batch must be at least 1, got dp={dp}, micro_batch={flags.micro_batch}")
    shards = zero_degrees(flags.zero, dp) if flags.zero is not None else (1, 1, 1)
    explicit = (flags.param_shard, flags.grad_shard, flags.optim_shard)
    if flags.zero is not None and any(v is not None for v in explicit):
        raise PlannerError("give either --zero or --param-shard/--grad-shard/--optim-shard, not both")
    shards = tuple(v if v is not None else s for v, s in zip(explicit, shards))
    schedule = flags.schedule or ("interleaved-1f1b" if flags.virtual_stages > 1 else "1f1b")
    kwargs = dict(
        dp=dp, tp=flags.tp, pp=flags.pp, virtual_stages=flags.virtual_stages, micro_batch=flags.micro_batch,
        num_micro_batches=micro_batches_for(global_batch=problem.job.global_batch, dp=dp,
                                            micro_batch=flags.micro_batch),
        schedule=schedule, recompute=flags.recompute, sequence_parallel=flags.sequence_parallel,
        param_shard=shards[0], grad_shard=shards[1], optim_shard=shards[2],
        prefetch_depth=flags.prefetch_depth, param_cache=flags.param_cache, commshift=flags.commshift)
    if flags.bucket_size_mb is not None:
        kwargs["bucket_size_bytes"] = max(1, int(flags.bucket_size_mb * 1024 * 1024))
    try:
        plan = Plan(**kwargs)
    except ValueError as exc:
        raise PlannerError(f"plan: {exc}") from None
    check_plan(plan, model=problem.model, num_devices=n, job=problem.job)
    return plan


def load_plan(path: str, problem: Problem | None = None) -> Plan:
    """A plan JSON file: either a bare plan object or the `{"plan": {...}, ...}` that search writes."""
    data = read_json_file(path, what="plan")
    if isinstance(data, dict) and "plan" in data and isinstance(data["plan"], dict):
        data = data["plan"]
    plan = Plan.from_dict(data, what=f"plan {path}")
    if problem is not None:
        check_plan(plan, model=problem.model, num_devices=problem.cluster.num_devices, job=problem.job)
    return plan
