"""`planner export`: the same plan as the input of an engine users already run, its launch script, what the
engine cannot express, and the cost model's price of the plan as that engine will run it.

    planner export --plan plan.json --to megatron
    planner export --plan plan.json --to torchtitan --out titan/
    planner export --plan plan.json --to deepspeed --format json

One file per target (torchtitan.py, megatron.py, deepspeed.py), each naming the release it was checked
against; the knob table (specs/plan.py, `Knob.exports`) says which plan knobs a target has, and
common.py turns the rest into one "cannot express" line each. A plan the target would reject is
refused with the closest plan it accepts.
"""

from __future__ import annotations

from specs.errors import PlannerError
from specs.plan import Plan
from specs.problem import Problem
from planner.exports.common import Export, ExportContext, Refused, describe_price

TARGETS = ("torchtitan", "megatron", "deepspeed")


def export_plan(plan: Plan, problem: Problem, *, target: str, engine: str | None = None) -> tuple[Export, object]:
    """`plan` for `target` (one of TARGETS, any case), and the Estimate of the plan as the target runs it,
    priced for `engine` (default: the target)."""
    from cost_models.estimate import estimate
    from planner.exports.deepspeed import export_deepspeed
    from planner.exports.megatron import export_megatron
    from planner.exports.torchtitan import export_torchtitan

    name = target.lower()
    builders = {"torchtitan": export_torchtitan, "megatron": export_megatron, "deepspeed": export_deepspeed}
    if name not in builders:
        raise PlannerError(f"--to must be one of {', '.join(TARGETS)}, got {target!r}")
    engine = engine or name

    def price(p: Plan):
        return estimate(p, model=problem.model, cluster=problem.cluster, job=problem.job, engine=engine)

    result = builders[name](plan, ExportContext(problem=problem, price=price))
    return result, price(result.expressed)


__all__ = ["TARGETS", "Export", "Refused", "describe_price", "export_plan"]
