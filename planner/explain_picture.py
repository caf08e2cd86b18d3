"""The picture of `planner explain`: one training step per pipeline rank, as the cost model prices it.

Per pipeline rank (its TP and DP peers run the same timeline) a compute lane and one lane per kind of
communication the plan has:

- compute: every forward (blue) and backward (green) of every micro-batch, labelled with the
  micro-batch ("F3") and, when ranks hold several chunks, the chunk ("F3 c1"), the chunk also in the
  shade; the part of an action that waits on communication hatched; bubbles dotted grey; the optimizer
  step at the end (purple);
- TP: the tensor-parallel collectives inside each action (they block it);
- ZeRO gather: parameter all-gathers, solid where the action waits for them (the first layer's), light
  where they are prefetched under compute, and the redistribution of updated shards after the step;
- DP reduce: gradient reduce-scatters per micro-batch (light: hidden under the backward; solid: the
  last bucket, after it) and the step-end all-reduce;
- pipeline: each activation sent to the next stage and each gradient sent back.

The rank whose step ends last is marked critical, and the rank with the most compute busiest (they
differ when the pipeline's drain, not its slowest stage, sets the end). The legend sits in its own
panel under the time axis.
"""

from __future__ import annotations

from dataclasses import dataclass

LANE_KINDS = ("tp", "gather", "reduce", "p2p")
LANE_NAMES = {"tp": "TP", "gather": "ZeRO gather", "reduce": "DP reduce", "p2p": "pipeline"}
COMM_COLORS = {"tp": "#c0392b", "gather": "#7d5ba6", "reduce": "#e08a2c", "p2p": "#16a085"}
# Shades per chunk on a rank (virtual stage 0, 1, ...): darker for later chunks.
SHADES = {"F": ("#6fa8e8", "#3a78c2", "#1f4f8f", "#123563"), "B": ("#7ccc7c", "#4a9e4a", "#2e6f2e", "#1b481b")}
OPTIMIZER, BUBBLE, MEASURED = "#a05cc0", "0.88", "#d64c4c"
LANE_HEIGHT = 0.7


def measured_phases(metrics) -> dict[str, float]:
    """Per-step timings the metrics carry besides the step time (comm_wait_s), in seconds."""
    return {"comm_wait_s": metrics.summary.comm_wait_s}


@dataclass
class _Bar:
    lane: str  # "compute" or one of LANE_KINDS
    start_s: float
    width_s: float
    color: str
    alpha: float = 1.0
    hatch: str | None = None
    label: str = ""


def lanes_of(ex) -> list[str]:
    """The communication lanes the plan has."""
    plan, chunks = ex.plan, ex.chunks
    present = {"tp": plan.tp > 1,
               "gather": any(c.gather_forward_first_s + c.gather_forward_rest_s > 0 for c in chunks)
               or any(post > 1e-3 * ex.estimate.step_time_s for _, post in ex.tails_s),
               "reduce": plan.dp_cp > 1,
               "p2p": plan.num_chunks > 1}
    return [k for k in LANE_KINDS if present[k]]


def _action_bars(ex, s) -> list[_Bar]:
    """The bars of one forward or backward span: the action, its waiting, and its communication by kind."""
    plan, cost = ex.plan, ex.chunks[s.chunk]
    width = s.end_s - s.start_s
    v = s.chunk // plan.pp
    text = f"{s.kind}{s.micro_batch}" + (f" c{v}" if plan.virtual_stages > 1 else "")
    bars = [_Bar("compute", s.start_s, width, SHADES[s.kind][v % 4], label=text)]
    forward = s.kind == "F"
    exposed = cost.forward_exposed_comm_s if forward else cost.backward_exposed_comm_s
    if s.last_backward and not plan.commshift and cost.reduce_s > 0:
        # Without commshift the step-end reduction runs alongside the chunk's last backward.
        bars.append(_Bar("reduce", s.start_s, min(cost.reduce_s, width), COMM_COLORS["reduce"]))
        exposed += max(0.0, width - cost.backward_s)
    if exposed > 0:
        bars.append(_Bar("compute", s.end_s - min(exposed, width), min(exposed, width), "none", hatch="///"))
    tp = cost.tp_forward_s if forward else cost.tp_backward_s
    if tp > 0:
        bars.append(_Bar("tp", s.start_s, min(tp, width), COMM_COLORS["tp"]))
    first = cost.gather_forward_first_s if forward else cost.gather_backward_first_s
    rest = cost.gather_forward_rest_s if forward else cost.gather_backward_rest_s
    if first > 0:
        bars.append(_Bar("gather", s.start_s, min(first, width), COMM_COLORS["gather"]))
    if rest > 0:
        bars.append(_Bar("gather", s.start_s + first, max(0.0, min(rest, width - first)), COMM_COLORS["gather"], 0.4))
    if not forward and cost.reduce_scatter_hidden_s + cost.reduce_scatter_last_s > 0:
        last = min(cost.reduce_scatter_last_s, width)
        bars.append(_Bar("reduce", s.start_s, max(0.0, min(cost.reduce_scatter_hidden_s, width - last)),
                         COMM_COLORS["reduce"], 0.4))
        bars.append(_Bar("reduce", s.end_s - last, last, COMM_COLORS["reduce"]))
    sends = s.chunk != plan.num_chunks - 1 if forward else s.chunk != 0
    if sends and ex.p2p_s > 0:
        bars.append(_Bar("p2p", s.end_s, ex.p2p_s, COMM_COLORS["p2p"]))
    return bars


def rank_bars(ex, rank: int) -> list[_Bar]:
    """Every bar of one pipeline rank: bubbles, actions, step-end reductions, optimizer, redistribution."""
    bars, previous = [], 0.0
    actions = sorted((s for s in ex.spans if s.rank == rank and s.kind != "R"), key=lambda s: s.start_s)
    for s in actions:
        if s.start_s > previous + 1e-12:  # a bubble: the rank waits for its input
            bars.append(_Bar("compute", previous, s.start_s - previous, BUBBLE, hatch=".."))
        previous = s.end_s
        bars += _action_bars(ex, s)
    reductions = [s for s in ex.spans if s.rank == rank and s.kind == "R"]
    bars += [_Bar("reduce", s.start_s, s.end_s - s.start_s, COMM_COLORS["reduce"]) for s in reductions]
    optimizer_s, post_s = ex.tails_s[rank]
    end = max([ex.compute_end_s[rank]] + [s.end_s for s in reductions])
    bars.append(_Bar("compute", end, optimizer_s, OPTIMIZER))
    if post_s > 0:
        bars.append(_Bar("gather", end + optimizer_s, post_s, COMM_COLORS["gather"]))
    return bars


def _rank_label(ex, rank: int) -> str:
    marks = [m for m, r in (("critical: ends last", ex.critical_rank), ("busiest", ex.busiest_rank)) if r == rank]
    return f"rank {rank}" + (f" ({', '.join(marks)})" if marks and ex.plan.pp > 1 else "")


def _legend_handles(ex, lanes: list[str], *, measured: bool):
    from matplotlib.patches import Patch

    v = ex.plan.virtual_stages
    handles = []
    for kind, name in (("F", "forward"), ("B", "backward")):
        handles += [Patch(color=SHADES[kind][c % 4], label=f"{name}, chunk {c}" if v > 1 else name) for c in range(v)]
    handles += [Patch(facecolor="white", edgecolor="k", hatch="///", label="waiting on communication"),
                Patch(facecolor=BUBBLE, hatch="..", label="bubble (waiting for the previous stage)"),
                Patch(color=OPTIMIZER, label="optimizer step")]
    descriptions = {"tp": "TP collectives (inside the action)",
                    "gather": "ZeRO parameter gather (light: prefetched under compute)",
                    "reduce": "DP gradient reduction (light: hidden under the backward)",
                    "p2p": "pipeline send (activation or gradient)"}
    handles += [Patch(color=COMM_COLORS[k], label=descriptions[k]) for k in lanes]
    if measured:
        handles.append(Patch(color=MEASURED, label="measured step"))
    return handles


def write_timeline_png(ex, path: str, *, metrics=None, title: str | None = None) -> None:
    """The step's timeline per pipeline rank (module docstring), with the measured step beside it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ms, pp = 1e3, ex.plan.pp
    lanes = lanes_of(ex)
    rows_per_rank = 1 + len(lanes)
    num_rows = pp * rows_per_rank + (1 if metrics is not None else 0)
    fig, (ax, legend_ax) = plt.subplots(2, 1, figsize=(14, 1.2 + 0.42 * num_rows + 1.1),
                                        gridspec_kw={"height_ratios": [1.2 + 0.42 * num_rows, 1.1]})
    ticks, labels, y = [], [], float(num_rows)
    for r in range(pp):
        ys = {"compute": y}
        ticks.append(y + LANE_HEIGHT / 2)
        labels.append(_rank_label(ex, r))
        for i, lane in enumerate(lanes, 1):
            ys[lane] = y - i
            ticks.append(y - i + LANE_HEIGHT / 2)
            labels.append(f"  {LANE_NAMES[lane]}")
        _draw(ax, rank_bars(ex, r), ys, step_s=ex.estimate.step_time_s)
        y -= rows_per_rank
        if r < pp - 1:
            ax.axhline(y + 1 - (1 - LANE_HEIGHT) / 2, color="0.75", lw=0.6)
    step_ms = ex.estimate.step_time_s * ms
    ax.axvline(step_ms, color="k", ls="--", lw=1)
    ax.text(step_ms, 1.0, f"predicted step {step_ms:.1f} ms", fontsize=8, va="bottom", ha="right",
            transform=ax.get_xaxis_transform())
    if metrics is not None:
        measured_ms = metrics.summary.median_step_time_s * ms
        ax.broken_barh([(0, measured_ms)], (y, LANE_HEIGHT), facecolor=MEASURED)
        phases = ", ".join(f"{k.removesuffix('_s')} {v * ms:.1f} ms" for k, v in measured_phases(metrics).items())
        ax.text(measured_ms, y + LANE_HEIGHT / 2, f"  measured step {measured_ms:.1f} ms ({phases})", fontsize=8,
                va="center")
        ax.axvline(measured_ms, color=MEASURED, ls=":", lw=1)
        ticks.append(y + LANE_HEIGHT / 2)
        labels.append("measured")
    ax.set_yticks(ticks)
    ax.set_yticklabels(labels, fontsize=8)
    ax.set_ylim((y + 1 if metrics is None else y) - 0.3, num_rows + 1)
    ax.set_xlabel("time in the step (ms)")
    ax.set_title(title or f"{ex.plan.describe()}: one step as the cost model sees it", fontsize=10)
    ax.grid(True, axis="x", alpha=0.3)
    legend_ax.axis("off")
    legend_ax.legend(handles=_legend_handles(ex, lanes, measured=metrics is not None), loc="center", ncol=3,
                     fontsize=7.5, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _draw(ax, bars: list[_Bar], ys: dict[str, float], *, step_s: float) -> None:
    ms = 1e3
    for b in bars:
        if b.width_s <= 0:
            continue
        y = ys.get(b.lane)
        if y is None:
            continue
        face = "none" if b.color == "none" else b.color
        # A short collective (a pipeline send, one reduce-scatter) is drawn at least a pixel or two wide.
        width_s = b.width_s if b.lane == "compute" else max(b.width_s, step_s / 700)
        ax.broken_barh([(b.start_s * ms, width_s * ms)], (y, LANE_HEIGHT), facecolor=face, alpha=b.alpha,
                       edgecolor="k" if b.hatch == "///" else ("white" if b.lane == "compute" else "none"),
                       hatch=b.hatch, lw=0 if b.hatch == "///" else 0.5)
        if b.label and b.width_s > step_s / 45:
            ax.text((b.start_s + b.width_s / 2) * ms, y + LANE_HEIGHT / 2, b.label, ha="center", va="center",
                    fontsize=6, color="white")
