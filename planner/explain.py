"""`planner explain`: one training step of a plan as the cost model sees it, per pipeline rank.

    planner explain --plan plan.json                    # a plan file from `planner search --out`
    planner explain --plan metrics.json --model tiny --hardware cpu --seq-len 64 --measured metrics.json

`explain` lays out the simulated step (cost_models/timeline.action_spans) with each chunk's price split
by kind (TP collectives, ZeRO gathers, gradient reductions, pipeline sends), names the critical pipeline
rank (whose step ends last) and the busiest one, and lists the Estimate's additive terms; the picture is
drawn by planner/explain_picture.py. With `--measured metrics.json` (a `planner run --metrics-out` file
of the same plan) the measured step time is drawn beside the predicted one.

Exposed communication per action is found by pricing the plan twice, with and without communication
(comm_time_scale = 0): the difference of the two action durations is the time the action waits on
collectives.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from specs.errors import PlannerError
from specs.knobs import show_value
from specs.problem import Problem
from specs.plan import Plan
from specs.hardware import with_calibration
from planner.explain_picture import measured_phases, write_timeline_png  # noqa: F401 - the picture (its own file)


@dataclass(frozen=True)
class ChunkCost:
    """Seconds per micro-batch of one chunk: its F and B actions, the part of each that waits on
    communication, the DP/ZeRO communication it overlaps with compute, and its communication by kind
    for the picture's lanes."""

    forward_s: float
    backward_s: float
    forward_exposed_comm_s: float
    backward_exposed_comm_s: float
    hidden_comm_s: float
    reduce_s: float
    # TP collectives inside the forward and the backward (blocking, part of the action).
    tp_forward_s: float = 0.0
    tp_backward_s: float = 0.0
    # ZeRO parameter gathers: the first layer's (waited for) and the rest (prefetched under compute).
    gather_forward_first_s: float = 0.0
    gather_forward_rest_s: float = 0.0
    gather_backward_first_s: float = 0.0
    gather_backward_rest_s: float = 0.0
    # Gradient reduce-scatter per micro-batch: hidden under the backward, and the last bucket after it.
    reduce_scatter_hidden_s: float = 0.0
    reduce_scatter_last_s: float = 0.0


@dataclass(frozen=True)
class Explanation:
    plan: Plan
    estimate: object  # cost_models.estimate.Estimate
    spans: tuple  # cost_models.timeline.Span
    chunks: tuple[ChunkCost, ...]
    tails_s: tuple[tuple[float, float], ...]  # per pipeline rank: (optimizer, post all-gather)
    compute_end_s: tuple[float, ...]
    critical_rank: int = 0  # the pipeline rank whose step ends last (ties: the busiest of them)
    p2p_s: float = 0.0  # one activation (or its gradient) between adjacent chunks
    busiest_rank: int = 0  # the pipeline rank with the most compute (the pipeline's bottleneck stage)


def explain(plan: Plan, problem: Problem) -> Explanation:
    """Price `plan` and lay out its step (module docstring)."""
    from cost_models import estimate as est
    from cost_models.timeline import action_spans

    model, cluster, job = problem.model, problem.cluster, problem.job
    estimate = est.estimate(plan, model=model, cluster=cluster, job=job)
    # The same pricing estimate() runs (its chunk prices and tails), once as is and once without comm.
    silent = dataclasses.replace(cluster, hardware=with_calibration(cluster.hardware, {"comm_time_scale": 0.0,
                                                                                       "collective_overhead_s": 0.0}))
    priced = est._chunk_prices(plan, est.layer_costs(plan, model=model, cluster=cluster, job=job), cluster,
                               model=model, job=job)
    quiet = est._chunk_prices(plan, est.layer_costs(plan, model=model, cluster=silent, job=job), silent,
                              model=model, job=job)
    chunks = [_chunk_cost(c, q) for c, q in zip(priced, quiet)]
    # The very durations estimate() simulates, step-end reductions placed as it places them.
    durations = est._step_end_durations(plan, cluster, chunks=priced, model=model, job=job)
    spans = action_spans(schedule=plan.schedule, pp=plan.pp, virtual_stages=plan.virtual_stages,
                         num_micro_batches=plan.num_micro_batches, durations=durations, commshift=True)
    tails = est._rank_tails(plan, cluster, chunks=priced, job=job, model=model)
    compute_end = tuple(max((s.end_s for s in spans if s.rank == r), default=0.0) for r in range(plan.pp))
    busy = [sum(s.end_s - s.start_s for s in spans if s.rank == r and s.kind != "R") for r in range(plan.pp)]
    ends = [max([compute_end[r]] + [s.end_s for s in spans if s.rank == r]) + sum(tails[r]) for r in range(plan.pp)]
    # Ranks that end within a part in a million of the last are tied: the busiest of them is critical.
    last = max(ends)
    critical = max((r for r in range(plan.pp) if ends[r] >= last * (1 - 1e-6)), key=lambda r: (busy[r], -r))
    return Explanation(plan=plan, estimate=estimate, spans=tuple(spans), chunks=tuple(chunks), tails_s=tuple(tails),
                       compute_end_s=compute_end, critical_rank=critical, p2p_s=durations.p2p_s,
                       busiest_rank=max(range(plan.pp), key=lambda r: (busy[r], -r)))


def _chunk_cost(c, q) -> ChunkCost:
    """A chunk's ChunkCost from its price with (`c`) and without (`q`) communication."""
    f_exposed, b_exposed = max(0.0, c.forward_s - q.forward_s), max(0.0, c.backward_s - q.backward_s)
    comm = c.comm
    # TP collectives split between forward and backward in proportion to their compute (the same layers'
    # activations pass in both; full recomputation repeats the forward's inside the backward).
    compute = c.forward_compute_s + c.backward_compute_s
    tp_forward = c.tp_comm_s * (c.forward_compute_s / compute if compute > 0 else 0.5)
    return ChunkCost(forward_s=c.forward_s, backward_s=c.backward_s, forward_exposed_comm_s=f_exposed,
                     backward_exposed_comm_s=b_exposed,
                     hidden_comm_s=max(0.0, c.tp_comm_s + c.dp_comm_s - f_exposed - b_exposed), reduce_s=c.reduce_s,
                     tp_forward_s=tp_forward, tp_backward_s=c.tp_comm_s - tp_forward,
                     gather_forward_first_s=comm.fwd_first_s if comm else 0.0,
                     gather_forward_rest_s=comm.fwd_rest_s if comm else 0.0,
                     gather_backward_first_s=comm.bwd_first_s if comm else 0.0,
                     gather_backward_rest_s=comm.bwd_rest_s if comm else 0.0,
                     reduce_scatter_hidden_s=comm.rs_hideable_s if comm else 0.0,
                     reduce_scatter_last_s=comm.rs_last_s if comm else 0.0)


# --- measured metrics -----------------------------------------------------------------------------
def load_measured(path: str, plan: Plan):
    """The RunMetrics of a `planner run --metrics-out` file, refused (naming the field) if it is for
    another plan."""
    from runners.config import RunMetrics
    from specs.jsonio import read_json_file

    data = read_json_file(path, what="metrics")
    if not isinstance(data, dict) or "plan" not in data or "summary" not in data:
        raise PlannerError(f"metrics file {path}: expected a `planner run --metrics-out` file with 'plan' and 'summary'")
    try:
        measured_plan = Plan.from_dict(data["plan"], what=f"metrics file {path}: plan")
    except (PlannerError, ValueError) as exc:
        raise PlannerError(str(exc)) from None
    for f in dataclasses.fields(Plan):
        mine, theirs = getattr(plan, f.name), getattr(measured_plan, f.name)
        if mine != theirs:
            raise PlannerError(f"metrics file {path} is for another plan: {f.name} is {show_value(theirs)} there, "
                               f"{show_value(mine)} here")
    return RunMetrics.from_dict(data, what=f"metrics file {path}")




# --- text -----------------------------------------------------------------------------------------
def breakdown_lines(ex: Explanation, *, metrics=None) -> list[str]:
    """The terminal breakdown: the additive terms of the critical rank, per-rank busy and bubble time,
    hidden communication, and measured beside predicted."""
    e, b = ex.estimate, ex.estimate.breakdown
    ms = 1e3
    lines = [f"plan: {ex.plan.describe()}",
             f"predicted step {e.step_time_s * ms:.2f} ms (critical pipeline rank {ex.critical_rank}: its step ends "
             f"last; busiest rank {ex.busiest_rank})"]
    for key in ("compute_s", "recompute_s", "exposed_comm_s", "bubble_s", "optimizer_s"):
        share = b[key] / e.step_time_s if e.step_time_s else 0.0
        lines.append(f"  {key.removesuffix('_s').replace('_', ' '):<15} {b[key] * ms:9.2f} ms  {share:6.1%}")
    lines.append(f"  (communication in all: TP {b['tp_comm_s'] * ms:.2f} ms, PP {b['pp_comm_s'] * ms:.2f} ms, "
                 f"DP/ZeRO {b['dp_comm_s'] * ms:.2f} ms per step)")
    m = ex.plan.num_micro_batches
    for r in range(ex.plan.pp):
        mine = ex.chunks[r::ex.plan.pp]
        busy = sum(s.end_s - s.start_s for s in ex.spans if s.rank == r and s.kind != "R")
        hidden = m * sum(c.hidden_comm_s for c in mine)
        lines.append(f"  pipeline rank {r}: busy {busy * ms:.2f} ms, idle (bubble) {(ex.compute_end_s[r] - busy) * ms:.2f} ms, "
                     f"comm hidden under compute {hidden * ms:.2f} ms, optimizer {ex.tails_s[r][0] * ms:.2f} ms")
    if metrics is not None:
        measured = metrics.summary.median_step_time_s
        lines.append(f"measured step {measured * ms:.2f} ms: predicted / measured = {e.step_time_s / measured:.2f}")
        for k, v in measured_phases(metrics).items():
            lines.append(f"  measured {k.removesuffix('_s').replace('_', ' ')}: {v * ms:.2f} ms")
    return lines


