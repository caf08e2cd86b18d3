"""planner explain: the per-action timeline agrees with the simulation and the estimate; metrics of
another plan are refused by name."""

from __future__ import annotations

import json

import pytest

from cost_models.timeline import ChunkDurations, action_spans, simulate_full
from specs.errors import PlannerError
from planner.explain import breakdown_lines, explain, load_measured, write_timeline_png
from specs.problem import make_problem
from specs.plan import Plan

CASES = [("gpipe", 2, 1, 4), ("1f1b", 4, 1, 8), ("interleaved-1f1b", 2, 2, 4), ("1f1b", 3, 1, 2)]


@pytest.mark.parametrize("schedule,pp,v,m", CASES)
@pytest.mark.parametrize("commshift", [False, True])
def test_spans_follow_the_simulation(schedule, pp, v, m, commshift):
    n = pp * v
    d = ChunkDurations(forward_s=tuple(1.0 + 0.1 * c for c in range(n)), backward_s=tuple(2.0 - 0.1 * c for c in range(n)),
                       p2p_s=0.05, reduce_s=(0.7,) * n, last_bucket_s=(0.2,) * n)
    spans = action_spans(schedule=schedule, pp=pp, virtual_stages=v, num_micro_batches=m, durations=d, commshift=commshift)
    full = simulate_full(schedule=schedule, pp=pp, virtual_stages=v, num_micro_batches=m, durations=d, commshift=commshift)
    compute = [s for s in spans if s.kind != "R"]
    assert len(compute) == 2 * n * m
    by_key = {(s.kind, s.chunk, s.micro_batch): s for s in compute}
    for r in range(pp):
        mine = sorted((s for s in compute if s.rank == r), key=lambda s: s.start_s)
        assert mine[-1].end_s == pytest.approx(full.compute_end_s[r])
        assert all(a.end_s <= b.start_s + 1e-12 for a, b in zip(mine, mine[1:]))  # one action at a time
        assert sum(s.end_s - s.start_s for s in mine) == pytest.approx(full.busy_s[r])
        reductions = [s for s in spans if s.rank == r and s.kind == "R"]
        assert len(reductions) == (v if commshift else 0)
        if commshift:
            assert max(s.end_s for s in reductions) == pytest.approx(full.comm_end_s[r])
    for s in compute:  # inputs arrive one transfer after the producing action ends
        dep = ("F", s.chunk - 1, s.micro_batch) if s.kind == "F" else ("B", s.chunk + 1, s.micro_batch)
        if dep in by_key:
            assert s.start_s >= by_key[dep].end_s + d.p2p_s - 1e-12


def _problem():
    return make_problem(model="tiny", hardware="cpu", gpus=4, gpus_per_node=4, global_batch=16, seq_len=64)


@pytest.mark.parametrize("plan", [
    Plan(dp=2, pp=2, num_micro_batches=8, param_shard=2, grad_shard=2, optim_shard=2),
    Plan(dp=1, tp=2, pp=2, virtual_stages=2, schedule="interleaved-1f1b", num_micro_batches=16),
    Plan(dp=4, num_micro_batches=4),
])
def test_explanation_adds_up_to_the_estimate(plan, tmp_path):
    ex = explain(plan, _problem())
    ends = [ex.compute_end_s[r] + sum(ex.tails_s[r]) for r in range(plan.pp)]
    assert max(ends) == pytest.approx(ex.estimate.step_time_s)
    for c in ex.chunks:
        assert 0 <= c.forward_exposed_comm_s <= c.forward_s and 0 <= c.backward_exposed_comm_s <= c.backward_s
    if plan.tp > 1:  # TP collectives sit on the critical path
        assert all(c.forward_exposed_comm_s > 0 for c in ex.chunks)
    text = "\n".join(breakdown_lines(ex))
    assert plan.describe() in text and "bubble" in text
    png = tmp_path / "step.png"
    write_timeline_png(ex, str(png))
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_measured_metrics_of_another_plan_are_refused(tmp_path):
    plan = Plan(dp=4, num_micro_batches=4)
    summary = {"median_step_time_s": 0.25, "tokens_per_s": 1000.0, "peak_memory_bytes": 2**28, "comm_bytes": {},
               "comm_wait_s": 0.01, "world_size": 4, "device": "cpu", "engine": "ours"}
    metrics = {"plan": plan.replace(micro_batch=2, num_micro_batches=2).to_dict(), "steps": [], "summary": summary}
    path = tmp_path / "m.json"
    path.write_text(json.dumps(metrics))
    with pytest.raises(PlannerError, match="micro_batch is 2 there, 1 here"):
        load_measured(str(path), plan)
    path.write_text(json.dumps({**metrics, "plan": plan.to_dict()}))
    good = load_measured(str(path), plan)
    ex = explain(plan, _problem())
    text = "\n".join(breakdown_lines(ex, metrics=good))
    assert "measured step 250.00 ms" in text and "measured comm wait: 10.00 ms" in text
    write_timeline_png(ex, str(tmp_path / "both.png"), metrics=good)
    path.write_text(json.dumps({"steps": []}))
    with pytest.raises(PlannerError, match="expected a `planner run --metrics-out` file"):
        load_measured(str(path), plan)


def test_critical_rank_ends_last_and_the_busiest_is_named_apart():
    problem = make_problem(model="llama3-8b", hardware="h100", gpus=16, gpus_per_node=8, global_batch=32, seq_len=8192)
    plan = Plan(dp=2, tp=2, pp=4, virtual_stages=2, schedule="interleaved-1f1b", micro_batch=1, num_micro_batches=16,
                sequence_parallel=True, optim_shard=2)
    ex = explain(plan, problem)
    busy = [sum(s.end_s - s.start_s for s in ex.spans if s.rank == r and s.kind != "R") for r in range(4)]
    ends = [ex.compute_end_s[r] + sum(ex.tails_s[r]) for r in range(4)]
    assert ex.busiest_rank == busy.index(max(busy)) == 3  # the last stage also computes the head and loss
    assert ends[ex.critical_rank] == pytest.approx(max(ends))
    text = "\n".join(breakdown_lines(ex))
    assert f"critical pipeline rank {ex.critical_rank}" in text and "busiest rank 3" in text


def test_the_picture_has_a_lane_per_kind_of_communication(tmp_path):
    from planner.explain_picture import lanes_of, rank_bars

    problem = make_problem(model="llama3-8b", hardware="h100", gpus=16, gpus_per_node=8, global_batch=32, seq_len=8192)
    zero3 = explain(Plan(dp=4, tp=2, pp=2, micro_batch=1, num_micro_batches=8, sequence_parallel=True, param_shard=4,
                         grad_shard=4, optim_shard=4), problem)
    assert lanes_of(zero3) == ["tp", "gather", "reduce", "p2p"]
    bars = rank_bars(zero3, 0)
    kinds = {b.lane for b in bars}
    assert kinds == {"compute", "tp", "gather", "reduce", "p2p"}
    # Each forward and backward is labelled with its micro-batch; rank 0's forwards send to rank 1.
    labels = [b.label for b in bars if b.label]
    assert labels.count("F0") == 1 and labels.count("B7") == 1
    assert sum(b.lane == "p2p" for b in bars) == 8
    ddp = explain(Plan(dp=16, micro_batch=1, num_micro_batches=2), problem)
    assert lanes_of(ddp) == ["reduce"]
    write_timeline_png(zero3, str(tmp_path / "z3.png"))
