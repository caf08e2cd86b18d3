"""`planner explain`: one training step of a plan as the cost model sees it, per pipeline rank.

    planner explain --plan plan.json --model tiny --hardware profile.json --gpus 4 --global-batch 16 --seq-len 64 --png step.png
    planner explain --plan plan.json ... --measured metrics.json

The picture has, per pipeline rank (its TP and DP peers run the same timeline), a compute lane with
every forward (F) and backward (B) of every micro-batch and chunk from the simulated schedule
(cost_models/timeline.action_spans), the part of each action spent waiting on exposed communication
(TP collectives, the first ZeRO gather, the last reduce-scatter bucket) hatched, the gaps (pipeline
bubbles) shaded, and the optimizer step at the end; and a communication lane with the step-end DP
reduction (inside the chunk's last backward without commshift, after it with commshift) and the
per-micro-batch DP/ZeRO communication that the separate stream hides under compute. With
`--measured metrics.json` (a `planner run --metrics-out` file of the same plan) the measured step time
is drawn beside the predicted one, with the phase timings the metrics carry.

Exposed communication per action is found by pricing the plan twice, with and without communication
(comm_time_scale = 0): the difference of the two action durations is the time the action waits on
collectives. The text breakdown lists the Estimate's additive terms.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from specs.errors import PlannerError
from specs.problem import Problem
from specs.plan import Plan
from specs.hardware import with_calibration


@dataclass(frozen=True)
class ChunkCost:
    """Seconds per micro-batch of one chunk: its F and B actions, the part of each that waits on
    communication, and the DP/ZeRO communication it overlaps with compute."""

    forward_s: float
    backward_s: float
    forward_exposed_comm_s: float
    backward_exposed_comm_s: float
    hidden_comm_s: float
    reduce_s: float


@dataclass(frozen=True)
class Explanation:
    plan: Plan
    estimate: object  # cost_models.estimate.Estimate
    spans: tuple  # cost_models.timeline.Span
    chunks: tuple[ChunkCost, ...]
    tails_s: tuple[tuple[float, float], ...]  # per pipeline rank: (optimizer, post all-gather)
    compute_end_s: tuple[float, ...]


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
    chunks = []
    for c, q in zip(priced, quiet):
        f_exposed, b_exposed = max(0.0, c.forward_s - q.forward_s), max(0.0, c.backward_s - q.backward_s)
        chunks.append(ChunkCost(forward_s=c.forward_s, backward_s=c.backward_s, forward_exposed_comm_s=f_exposed,
                                backward_exposed_comm_s=b_exposed,
                                hidden_comm_s=max(0.0, c.tp_comm_s + c.dp_comm_s - f_exposed - b_exposed),
                                reduce_s=c.reduce_s))
    # The very durations estimate() simulates, step-end reductions placed as it places them.
    durations, off_the_send = est._step_end_durations(plan, cluster, chunks=priced,
                                                      p2p_s=est._p2p_time_s(plan, cluster, model=model, job=job))
    spans = action_spans(schedule=plan.schedule, pp=plan.pp, virtual_stages=plan.virtual_stages,
                         num_micro_batches=plan.num_micro_batches, durations=durations, commshift=off_the_send)
    tails = est._rank_tails(plan, cluster, chunks=priced, job=job, model=model)
    compute_end = tuple(max((s.end_s for s in spans if s.rank == r), default=0.0) for r in range(plan.pp))
    return Explanation(plan=plan, estimate=estimate, spans=tuple(spans), chunks=tuple(chunks), tails_s=tuple(tails),
                       compute_end_s=compute_end)


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
            raise PlannerError(f"metrics file {path} is for another plan: {f.name} is {theirs!r} there, {mine!r} here")
    return RunMetrics.from_dict(data, what=f"metrics file {path}")


def measured_phases(metrics) -> dict[str, float]:
    """Per-step timings the metrics carry besides the step time (comm_wait_s), in seconds."""
    return {"comm_wait_s": metrics.summary.comm_wait_s}


# --- text -----------------------------------------------------------------------------------------
def breakdown_lines(ex: Explanation, *, metrics=None) -> list[str]:
    """The terminal breakdown: the additive terms of the critical rank, per-rank busy and bubble time,
    hidden communication, and measured beside predicted."""
    e, b = ex.estimate, ex.estimate.breakdown
    ms = 1e3
    lines = [f"plan: {ex.plan.describe()}",
             f"predicted step {e.step_time_s * ms:.2f} ms (critical pipeline rank {int(b['critical_rank'])})"]
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


# --- the picture ----------------------------------------------------------------------------------
def write_timeline_png(ex: Explanation, path: str, *, metrics=None, title: str | None = None) -> None:
    """The step's timeline per pipeline rank (module docstring), with the measured step beside it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    pp, ms = ex.plan.pp, 1e3
    colors = {"F": "#4c8bd6", "B": "#5db35d", "R": "#e08a2c"}
    step_ms = ex.estimate.step_time_s * ms
    fig, ax = plt.subplots(figsize=(13, 1.6 + 1.3 * pp + (0.8 if metrics else 0)))
    labels, ticks = [], []
    for r in range(pp):
        y = (pp - r) * 2.0  # compute lane; the comm lane sits just below it
        ticks += [y + 0.35, y - 0.45]
        labels += [f"rank {r} compute", f"rank {r} comm"]
        busy = sorted((s for s in ex.spans if s.rank == r and s.kind != "R"), key=lambda s: s.start_s)
        previous = 0.0
        for s in busy:
            if s.start_s > previous + 1e-12:  # a bubble: the rank waits for its input
                ax.broken_barh([(previous * ms, (s.start_s - previous) * ms)], (y, 0.7), color="0.9", hatch="..")
            previous = s.end_s
            cost = ex.chunks[s.chunk]
            width = (s.end_s - s.start_s) * ms
            ax.broken_barh([(s.start_s * ms, width)], (y, 0.7), facecolor=colors[s.kind], edgecolor="white", lw=0.5)
            exposed = (cost.forward_exposed_comm_s if s.kind == "F" else cost.backward_exposed_comm_s) * ms
            if s.last_backward and not ex.plan.commshift and cost.reduce_s > 0:
                # The reduction runs alongside this backward and its send waits for it.
                ax.broken_barh([(s.start_s * ms, min(cost.reduce_s * ms, width))], (y - 0.8, 0.7), facecolor=colors["R"])
                exposed += max(0.0, width - cost.backward_s * ms)  # what the reduction adds to the action
            if exposed > 0:
                ax.broken_barh([(s.end_s * ms - exposed, exposed)], (y, 0.7), facecolor="none", edgecolor="k",
                               hatch="///", lw=0)
            hidden = cost.hidden_comm_s / 2 * ms  # spread over the chunk's forward and backward
            if hidden > 0:
                ax.broken_barh([(s.start_s * ms, min(hidden, width))], (y - 0.8, 0.7), facecolor="0.6", alpha=0.5)
            if width > step_ms / 60:
                ax.text(s.start_s * ms + width / 2, y + 0.35, f"{s.kind}{s.micro_batch}", ha="center", va="center",
                        fontsize=6, color="white")
        for s in ex.spans:
            if s.rank == r and s.kind == "R":
                ax.broken_barh([(s.start_s * ms, (s.end_s - s.start_s) * ms)], (y - 0.8, 0.7), facecolor=colors["R"])
        optimizer_s, post_s = ex.tails_s[r]
        end = max(ex.compute_end_s[r], max((s.end_s for s in ex.spans if s.rank == r and s.kind == "R"), default=0.0))
        ax.broken_barh([(end * ms, optimizer_s * ms)], (y, 0.7), facecolor="#a05cc0")
        if post_s > 0:
            ax.broken_barh([((end + optimizer_s) * ms, post_s * ms)], (y - 0.8, 0.7), facecolor="#c04c8b")
    ax.axvline(step_ms, color="k", ls="--", lw=1)
    ax.text(step_ms, 1.0, f"predicted step {step_ms:.1f} ms", fontsize=8, va="bottom", ha="right",
            transform=ax.get_xaxis_transform())
    if metrics is not None:
        measured_ms = metrics.summary.median_step_time_s * ms
        ax.broken_barh([(0, measured_ms)], (0.3, 0.6), facecolor="#d64c4c")
        phases = ", ".join(f"{k.removesuffix('_s')} {v * ms:.1f} ms" for k, v in measured_phases(metrics).items())
        ax.text(0, 1.0, f"measured step {measured_ms:.1f} ms" + (f" ({phases})" if phases else ""), fontsize=8)
        ax.axvline(measured_ms, color="#d64c4c", ls=":", lw=1)
        ticks.append(0.6)
        labels.append("measured")
    ax.set_yticks(ticks)
    ax.set_yticklabels(labels, fontsize=8)
    ax.set_xlabel("time in the step (ms)")
    ax.legend(handles=[Patch(color=colors["F"], label="forward"), Patch(color=colors["B"], label="backward"),
                       Patch(facecolor="white", edgecolor="k", hatch="///", label="waiting on communication"),
                       Patch(color="0.9", hatch="..", label="bubble"),
                       Patch(color="0.6", alpha=0.5, label="comm hidden under compute"),
                       Patch(color=colors["R"], label="DP gradient reduction"),
                       Patch(color="#a05cc0", label="optimizer"), Patch(color="#c04c8b", label="parameter all-gather")],
              loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=4, fontsize=7, frameon=False)
    ax.set_title(title or f"{ex.plan.describe()}: one step as the cost model sees it", fontsize=10)
    ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
