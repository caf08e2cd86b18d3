"""What every exporter shares: the Export result, the knob table's "cannot express" lines, the sharding
points a target offers, and short renderings of long per-layer values."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from specs.errors import PlannerError
from specs.knobs import export_rule_allows, show_value
from specs.plan import PLAN_KNOBS, Plan
from specs.problem import Problem


@dataclass(frozen=True)
class Export:
    """A plan as another engine's input.

    `files` maps file names to their text (the target's config, the model definition where the target
    takes one, and `launch.sh`); `main` names the one printed when no --out is given. `expressed` is the
    plan as the target will run it (every substitution applied), which is what gets priced;
    `cannot_express` has one line per knob the target cannot express; `settings` is the target's own
    settings as data (flags, config keys), for --format json and the tests."""

    target: str
    version: str
    files: dict[str, str]
    main: str
    expressed: Plan
    cannot_express: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    settings: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"target": self.target, "version": self.version, "main": self.main, "files": self.files,
                "expressed_plan": self.expressed.to_dict(), "cannot_express": list(self.cannot_express),
                "notes": list(self.notes), "settings": self.settings}


@dataclass(frozen=True)
class ExportContext:
    """What an exporter works from: the problem, and the cost model's price of a plan for its target
    (`price(plan)` returns a cost_models.estimate.Estimate), used to name the closest accepted plan."""

    problem: Problem
    price: Callable[[Plan], object]


class Refused(PlannerError):
    """The target would reject this plan; the message names the closest plan it accepts."""


def short(value) -> str:
    """A knob value in a message (specs.knobs.show_value: per-layer tuples as counts)."""
    return show_value(value)


def knob_table_gaps(plan: Plan, target: str) -> tuple[dict, list[str]]:
    """The knobs `target` cannot express (their export rules in the knob table, specs/plan.py): the
    changes that reset each to its default, and one line per knob from its help."""
    changes, lines = {}, []
    for spec in PLAN_KNOBS:
        value = getattr(plan, spec.name)
        if export_rule_allows(spec.knob.exports.get(target), value, spec.default):
            continue
        changes[spec.name] = spec.default
        lines.append(f"{spec.name}={short(value)}: {target} has no setting for it ({spec.knob.help.rstrip('.')}); "
                     f"exported as {short(spec.default)}")
    return changes, lines


def dominant_recompute(plan: Plan) -> str:
    """The one recomputation policy for every layer: the plan's, or its per-layer mix's most common
    (ties towards recomputing more, so the export does not need more memory than the plan)."""
    if plan.recompute_layers is None:
        return plan.recompute
    layers = plan.recompute_layers
    return max(("full", "selective", "none"), key=lambda p: (layers.count(p), ("none", "selective", "full").index(p)))


def uniform_recompute(plan: Plan, target: str) -> tuple[dict, list[str]]:
    """A per-layer recomputation mix as one policy (no target sets it per layer in the same way)."""
    if plan.recompute_layers is None or len(set(plan.recompute_layers)) == 1:
        policy = plan.recompute if plan.recompute_layers is None else plan.recompute_layers[0]
        return {"recompute": policy, "recompute_layers": None}, []
    policy = dominant_recompute(plan)
    return ({"recompute": policy, "recompute_layers": None},
            [f"recompute_layers={short(plan.recompute_layers)}: {target} takes one policy for every layer; "
             f"exported as {policy!r}"])


def cover_sharding(plan: Plan, points: list[tuple[int, int, int]]) -> tuple[int, int, int]:
    """The least-sharded of `points` that shards each of parameters, gradients and optimizer states at
    least as much as the plan (so the export needs no more memory for model states), or the plan's own
    point when it is one of them."""
    mine = plan.shard_degrees
    if mine in points:
        return mine
    covering = [p for p in points if all(a >= b for a, b in zip(p, mine))]
    return min(covering, key=lambda p: (sum(p), p))


def sharding_name(degrees: tuple[int, int, int], dp: int) -> str:
    names = {(1, 1, 1): "ZeRO-0", (1, 1, dp): "ZeRO-1", (1, dp, dp): "ZeRO-2", (dp, dp, dp): "ZeRO-3"}
    if dp > 1 and degrees in names:
        return f"{names[degrees]} {degrees}"
    return f"shard degrees {degrees}"


def describe_price(estimate) -> str:
    """'predicted 1.23 s/step, 61.2 of 80.0 GiB per device' (and 'does not fit' when it does not)."""
    gib = 2**30
    text = (f"predicted {estimate.step_time_s:.4g} s/step, {estimate.peak_memory_bytes / gib:.1f} of "
            f"{estimate.memory_limit_bytes / gib:.1f} GiB per device")
    return text if estimate.fits else text + ": does not fit"


def refuse(target: str, version: str, why: str, closest: Plan, ctx: ExportContext) -> Refused:
    """The error for a plan `target` would reject, naming the closest plan it accepts and its price."""
    return Refused(f"{version} would reject this plan ({why}); the closest plan it accepts is "
                   f"{closest.describe()} ({describe_price(ctx.price(closest))})")


def dp_ranks_per_node(plan: Plan, problem: Problem) -> int:
    """DP ranks inside one node (ranks are laid out TP innermost, then DP: specs/cluster.py)."""
    return max(1, min(plan.dp, problem.cluster.devices_per_node // plan.tp))


def launch_header(version: str, plan: Plan, problem: Problem) -> list[str]:
    model, cluster, job = problem.model, problem.cluster, problem.job
    return ["#!/usr/bin/env bash",
            f"# planner export for {version}",
            f"# plan as exported: {plan.describe()}",
            f"# {model.name} on {cluster.num_devices} x {cluster.hardware.name} ({cluster.num_nodes} node(s) of "
            f"{cluster.devices_per_node}), global batch {job.global_batch} x {job.seq_len} tokens, {job.precision}",
            "set -euo pipefail"]
