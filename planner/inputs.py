"""Build the four inputs (model, cluster, job, plan) from command-line values; shared by every command."""

from __future__ import annotations

from typing import Any

from specs.errors import PlannerError
from specs.jsonio import read_json_file
from specs.knobs import cli_value
from specs.plan import PLAN_KNOBS, Plan, check_plan, micro_batches_for, zero_degrees
from specs.problem import Problem


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
    tp, pp = values.setdefault("tp", 1), values.setdefault("pp", 1)
    if tp < 1 or pp < 1:
        raise PlannerError(f"--tp and --pp must be at least 1, got tp={tp}, pp={pp}")
    if "dp" not in values and n % (tp * pp):
        raise PlannerError(f"tp x pp = {tp * pp} does not divide the {n} devices")
    dp = values.setdefault("dp", n // (tp * pp))
    if dp * tp * pp != n:  # before the batch arithmetic, whose message would hide the real mismatch
        raise PlannerError(f"dp x tp x pp = {dp} x {tp} x {pp} = {dp * tp * pp}, but the cluster has {n} devices")
    micro_batch = values.setdefault("micro_batch", 1)
    if dp < 1 or micro_batch < 1:
        raise PlannerError(f"--dp and --micro-batch must be at least 1, got dp={dp}, micro_batch={micro_batch}")
    shard_names = ("param_shard", "grad_shard", "optim_shard")
    if zero is not None:
        if any(name in values for name in shard_names):
            raise PlannerError("give either --zero or --param-shard/--grad-shard/--optim-shard, not both")
        values.update(zip(shard_names, zero_degrees(zero, dp)))
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
    """A plan JSON file: either a bare plan object or the `{"plan": {...}, ...}` that search writes."""
    data = read_json_file(path, what="plan")
    if isinstance(data, dict) and "plan" in data and isinstance(data["plan"], dict):
        data = data["plan"]
    plan = Plan.from_dict(data, what=f"plan {path}")
    if problem is not None:
        check_plan(plan, model=problem.model, num_devices=problem.cluster.num_devices, job=problem.job)
    return plan
