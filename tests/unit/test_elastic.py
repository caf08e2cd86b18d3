"""Elastic runs and the checkpoint cadence: Young/Daly and goodput against hand-computed values, the
plan-per-world table, the launcher's record of changes, and the flags' one-line errors."""

from __future__ import annotations

import math

import pytest

from cost_models.checkpoint import (DEFAULT_STORAGE_WRITE_BYTES_PER_S, cadence, checkpoint_write_s, daly_interval_s,
                                    expected_goodput, young_interval_s)
from runners.config import RunConfig, WorldPlan
from runners.elastic import ElasticLog, parse_node_range, torchrun_elastic_args
from specs.errors import PlannerError
from specs.job import Job
from specs.model import PRESETS
from specs.plan import Plan, check_plan


def test_young_and_daly_against_hand_computed_values():
    # C = 10 s, M = 5000 s: Young sqrt(2 x 10 x 5000) = sqrt(1e5) = 316.2278 s; Daly with C/2M = 0.001:
    # 316.2278 x (1 + 0.0316228 / 3 + 0.001 / 9) - 10 = 316.2278 x 1.0106520 - 10 = 309.5962 s.
    assert young_interval_s(write_s=10, mtbf_s=5000) == pytest.approx(316.227766, rel=1e-9)
    assert daly_interval_s(write_s=10, mtbf_s=5000) == pytest.approx(309.596234, rel=1e-7)
    assert daly_interval_s(write_s=1e-3, mtbf_s=1e6) == pytest.approx(young_interval_s(write_s=1e-3, mtbf_s=1e6), rel=1e-3)
    assert daly_interval_s(write_s=300, mtbf_s=100) == 100  # a checkpoint dearer than 2 M: once per M
    with pytest.raises(ValueError, match="MTBF positive"):
        young_interval_s(write_s=1, mtbf_s=0)


def test_goodput_against_hand_computed_values():
    # tau 90 s, C 10 s, R 50 s, M 1000 s: 90 / 100 x (1 - (50 + 100 / 2) / 1000) = 0.9 x 0.9 = 0.81.
    assert expected_goodput(interval_s=90, write_s=10, mtbf_s=1000, restart_s=50) == pytest.approx(0.81)
    assert expected_goodput(interval_s=90, write_s=10, mtbf_s=60, restart_s=50) == 0.0
    # Daly's interval is (near) the best one: goodput falls either side of it.
    best = daly_interval_s(write_s=10, mtbf_s=5000)
    at = lambda tau: expected_goodput(interval_s=tau, write_s=10, mtbf_s=5000, restart_s=0)  # noqa: E731
    assert at(best) > at(best / 2) and at(best) > at(best * 2)


def test_checkpoint_price_and_cadence_in_steps():
    # 1e6 parameters x 12 bytes over 2 nodes at 1 GB/s each: 12e6 / 2e9 = 6 ms.
    assert checkpoint_write_s(num_params=10**6, num_nodes=2, storage_write_bytes_per_s=1e9) == pytest.approx(6e-3)
    assert checkpoint_write_s(num_params=10**6, num_nodes=1, storage_write_bytes_per_s=0) == pytest.approx(
        12e6 / DEFAULT_STORAGE_WRITE_BYTES_PER_S)
    # C 2 s, M 3600 s: Daly 118.0 s of work; at 0.5 s a step, every 236 steps.
    c = cadence(step_time_s=0.5, write_s=2.0, mtbf_s=3600.0, restart_s=30.0)
    assert c.every_steps == round(c.interval_s / 0.5) and 117 < c.interval_s < 119
    assert c.goodput == pytest.approx(118 / 120 * (1 - (30 + 60) / 3600), rel=1e-2)


def test_plan_table_gives_every_world_a_valid_plan_with_the_same_global_batch():
    from specs.problem import make_problem
    from planner.elastic import plan_table

    def problem_for(devices: int):
        return make_problem(model="tiny", hardware="cpu", gpus=devices, gpus_per_node=2, global_batch=8, seq_len=64,
                            precision="fp32")

    table = plan_table(problem_for, nodes=(1, 2), procs_per_node=2)
    assert [e.world_size for e in table.entries] == [2, 4]
    for entry in table.entries:
        problem = problem_for(entry.world_size)
        check_plan(entry.plan, model=problem.model, num_devices=entry.world_size, job=problem.job)
        assert entry.plan.global_batch == 8 and entry.predicted["step_time_s"] > 0
    assert table.plan_for(4).plan.world_size == 4
    with pytest.raises(PlannerError, match="no elastic plan for 6"):
        table.plan_for(6)


def test_run_config_picks_the_plan_of_its_world_and_round_trips():
    job = Job(global_batch=8, seq_len=32, precision="fp32")
    plans = (WorldPlan(2, Plan(dp=2, micro_batch=4)), WorldPlan(4, Plan(dp=4, micro_batch=2)))
    cfg = RunConfig(plan=plans[1].plan, model=PRESETS["tiny"], job=job, checkpoint_dir="ckpt", elastic_plans=plans)
    again = RunConfig.from_dict(cfg.to_dict())
    assert again == cfg and again.for_world(2).plan == plans[0].plan
    with pytest.raises(ValueError, match="plans for 2, 4 processes, but 3"):
        cfg.for_world(3)
    with pytest.raises(ValueError, match="needs a checkpoint_dir"):
        RunConfig(plan=plans[1].plan, model=PRESETS["tiny"], job=job, elastic_plans=plans)
    with pytest.raises(ValueError, match="has 4 ranks"):
        WorldPlan(2, Plan(dp=4))


def test_elastic_log_records_lost_replanned_resumed_and_scaled_up():
    log = ElasticLog(start_wall_s=100.0)

    def feed(kind, t, **fields):
        return [e.kind for e in log.on_event({"kind": kind, "time": t, **fields})]

    assert feed("plan", 101, world_size=4, plan="dp4") == []
    assert feed("resumed", 102, step=0, world_size=4) == []
    for step in range(7):
        feed("step", 103 + step, step=step, loss=1.0 + step, step_time_s=0.1)
    assert feed("failed", 110, rank=0, message="Connection reset by peer") == ["lost"]
    assert feed("failed", 110.5, rank=1, message="Connection reset by peer") == []  # once per start
    assert feed("plan", 120, world_size=2, plan="dp2") == ["replanned"]
    assert feed("resumed", 121, step=5, world_size=2) == ["resumed"]
    feed("step", 122, step=5, loss=-5.0, step_time_s=0.2)  # the step trained again: its new record wins
    assert feed("plan", 130, world_size=4, plan="dp4") == ["scaled_up", "replanned"]
    assert feed("resumed", 131, step=5, world_size=4) == ["resumed"]
    lost, _, shrink, grow, _, regrow = log.events
    assert (lost.time_s, lost.world_size, lost.step) == (10.0, 4, 7)
    assert (shrink.step, shrink.steps_lost, shrink.world_size) == (5, 2, 2)
    assert (grow.kind, grow.world_size, regrow.steps_lost) == ("scaled_up", 4, 1)
    assert [r.loss for r in log.merged_steps()] == [1.0, 2.0, 3.0, 4.0, 5.0, -5.0, 7.0]


def test_elastic_log_takes_the_steps_a_checkpoint_replays():
    """A start stopped between saving checkpoint 10 and reporting step 9 trained a step nobody heard of:
    the next start resumes from 10 and replays the checkpoint's records, which fill the gap without
    counting as progress of the new start."""
    log = ElasticLog(start_wall_s=0.0)
    log.on_event({"kind": "plan", "time": 1, "world_size": 2, "plan": "dp2"})
    for step in range(9):
        log.on_event({"kind": "step", "time": 2, "step": step, "loss": float(step), "step_time_s": 0.1})
    log.on_event({"kind": "plan", "time": 3, "world_size": 4, "plan": "dp4"})
    log.on_event({"kind": "resumed", "time": 4, "step": 10, "world_size": 4})
    for step in range(5, 10):
        log.on_event({"kind": "step", "time": 4, "step": step, "loss": 100.0 + step, "step_time_s": 0.1, "replayed": True})
    assert log.steps_done == 10
    assert [r.step for r in log.merged_steps()] == list(range(10))
    assert [r.loss for r in log.merged_steps()][4:] == [4.0, 105.0, 106.0, 107.0, 108.0, 109.0]


def test_node_ranges_and_torchrun_arguments():
    assert parse_node_range("1:2") == (1, 2) and parse_node_range("3") == (3, 3)
    for bad in ("2:1", "0:2", "a:b", "1:2:3", ""):
        with pytest.raises(ValueError, match="MIN:MAX"):
            parse_node_range(bad)
    args = torchrun_elastic_args(nodes=(1, 2), endpoint="10.77.0.1:29517", run_id="x", max_restarts=3, is_host=True,
                                 local_addr="10.77.0.1")
    assert "--nnodes=1:2" in args and "--rdzv-backend=c10d" in args and "--local-addr=10.77.0.1" in args
    conf = next(a for a in args if a.startswith("--rdzv-conf="))
    assert "is_host=1" in conf and "last_call_timeout=1" in conf and "keep_alive_max_attempt=3" in conf


def test_store_prefix_only_on_the_agent_store(monkeypatch):
    from runners.faults import store_attempt_prefix

    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    assert store_attempt_prefix() == "planner/attempt2/"
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")  # elastic: a fresh store per attempt
    assert store_attempt_prefix() == ""


def test_partial_writes_are_removed_and_complete_ones_kept(tmp_path):
    from runners import checkpoint as ck

    complete = tmp_path / ck.step_dir_name(4)
    complete.mkdir()
    for name in (ck.step_dir_name(6) + ".tmp", ck.step_dir_name(2) + ".old"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__0_0.distcp").write_bytes(b"half")
    removed = ck.remove_partial_writes(tmp_path)
    assert sorted(p.name for p in removed) == [ck.step_dir_name(2) + ".old", ck.step_dir_name(6) + ".tmp"]
    assert [p.name for p in tmp_path.iterdir()] == [complete.name]


@pytest.mark.parametrize("flags, message", [
    (["--elastic", "2:1", "--checkpoint-dir", "c", "--max-restarts", "1", "--rdzv-endpoint", "h:1"], "MIN:MAX"),
    (["--elastic", "1:2", "--checkpoint-dir", "c", "--rdzv-endpoint", "h:1"], "--max-restarts N >= 1"),
    (["--elastic", "1:2", "--checkpoint-dir", "c", "--max-restarts", "1"], "--rdzv-endpoint HOST:PORT, or --cluster"),
    (["--elastic", "1:2", "--checkpoint-dir", "c", "--max-restarts", "1", "--rdzv-endpoint", "h:1", "--tp", "2"],
     "give no plan options"),
    (["--mtbf", "600", "--checkpoint-every", "5", "--checkpoint-dir", "c"], "not both"),
    (["--mtbf", "600"], "--mtbf needs --checkpoint-dir"),
    (["--mtbf", "-1", "--checkpoint-dir", "c"], "positive number of seconds"),
])
def test_bad_elastic_and_mtbf_flags_are_one_line(flags, message, monkeypatch, capsys):
    import sys

    from planner.cli import main

    monkeypatch.setattr(sys, "argv", ["planner", "run", "--hardware", "cpu", "--nproc", "2", *flags])
    with pytest.raises(SystemExit) as info:
        main()
    err = capsys.readouterr().err
    assert info.value.code == 2 and message in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) <= 2  # one line, wrapped at most once


def test_estimate_reports_the_cadence_and_goodput():
    import json

    from typer.testing import CliRunner

    from planner.cli import app

    result = CliRunner().invoke(app, ["estimate", "--model", "tiny", "--hardware", "cpu", "--gpus", "2", "--global-batch",
                                      "8", "--mtbf", "600", "--format", "json"])
    assert result.exit_code == 0, result.output
    c = json.loads(result.output)["checkpoint"]
    assert c["mtbf_s"] == 600 and c["every_steps"] == max(1, round(c["interval_s"] / c["step_time_s"]))
    assert 0 < c["goodput"] < 1 and math.isclose(c["interval_s"], daly_interval_s(write_s=c["write_s"], mtbf_s=600))
