"""Plan knobs ep / etp: the folding rule, one-line checks, and the expert groups of the mesh."""

import pytest

from specs.errors import PlannerError
from specs.job import Job
from specs.model import PRESETS
from specs.plan import PLAN_KNOBS, Plan, check_plan
from runners.mesh import mesh_groups

MOE = PRESETS["tiny-moe"]


def _check(plan, model=MOE):
    check_plan(plan, model=model, num_devices=plan.world_size, job=Job(global_batch=plan.global_batch, seq_len=32))


def test_ep_and_etp_are_knobs_declared_once():
    names = [k.name for k in PLAN_KNOBS]
    assert names.count("ep") == 1 and names.count("etp") == 1
    assert {k.flag for k in PLAN_KNOBS if k.name in ("ep", "etp")} == {"--ep", "--etp"}


def test_folding_rule():
    # tp x cp x dp = 2 x 1 x 4 = 8 ranks per stage fold as etp x ep x expert-DP.
    plan = Plan(dp=4, tp=2, ep=4, sequence_parallel=True)
    assert plan.expert_dp == 2
    assert Plan(dp=4, ep=2, param_shard=4, grad_shard=4, optim_shard=4).expert_shard_degrees == (2, 2, 2)
    assert Plan(dp=4, ep=1, grad_shard=2, optim_shard=4).expert_shard_degrees == (1, 2, 4)
    with pytest.raises(ValueError, match=r"etp x ep = 1 x 8 = 8 does not divide the tp x cp x dp = 4 ranks"):
        Plan(dp=4, ep=8)


def test_one_line_checks():
    with pytest.raises(PlannerError, match="ep 2 and etp 1 need a mixture-of-experts model; tiny is dense"):
        _check(Plan(dp=2, ep=2), model=PRESETS["tiny"])
    with pytest.raises(PlannerError, match="ep 4 does not divide the model's num_experts 6"):
        _check(Plan(dp=4, ep=4), model=MOE.__class__(**{**MOE.__dict__, "num_experts": 6}))
    with pytest.raises(PlannerError, match="etp 2 does not divide the model's expert_ffn_hidden_size 33"):
        _check(Plan(dp=2, etp=2), model=MOE.__class__(**{**MOE.__dict__, "expert_ffn_hidden_size": 33}))
    with pytest.raises(PlannerError, match="an MoE model with tp 2 needs sequence_parallel"):
        _check(Plan(dp=2, tp=2, ep=2))
    _check(Plan(dp=2, tp=2, ep=2, sequence_parallel=True))


def test_plan_json_round_trips_ep():
    plan = Plan(dp=4, ep=2, etp=2)
    assert Plan.from_dict(plan.to_dict()) == plan and "ep2etp2" in plan.describe()


def _partition(groups, kind, world):
    ranks = sorted(r for k, g in groups if k == kind for r in g)
    return ranks == list(range(world))


def test_expert_groups_fold_over_the_stage():
    plan = Plan(dp=2, tp=2, pp=2, ep=2, sequence_parallel=True)  # 8 ranks, 4 per stage, expert-DP 2
    groups = mesh_groups(plan, moe=True)
    for kind in ("ep", "etp", "expert_dp", "expert_param", "expert_grad"):
        assert _partition(groups, kind, 8), kind
    ep = [g for k, g in groups if k == "ep"]
    # Stage 0 is ranks 0-3 (r = q x tp + t); EP groups are consecutive pairs, expert-DP pairs two apart.
    assert ep == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert [g for k, g in groups if k == "expert_dp"] == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert not any(k.startswith("expert_") or k == "ep" for k, _ in mesh_groups(plan, moe=False))
