"""Optuna tuning: resumable studies, a fixed seed, and a round trip between plans and trial parameters."""

import optuna
import pytest

from cost_models.estimate import estimate
from specs.problem import make_problem
from specs.plan import Plan
from planner.optuna_search import base_params, plan_from_trial, refine_with_optuna


@pytest.fixture
def problem():
    return make_problem(model="tiny", hardware="cpu", gpus=8, gpus_per_node=8, global_batch=32, seq_len=64)


BASE = Plan(dp=2, tp=2, pp=2, micro_batch=2, num_micro_batches=8, schedule="1f1b", recompute="selective",
            sequence_parallel=True, param_shard=2, grad_shard=2, optim_shard=2, param_cache="host", commshift=True)


@pytest.mark.parametrize("plan", [
    BASE,
    BASE.replace(param_shard=1, grad_shard=1, optim_shard=2, param_cache="none", recompute="none",
                 sequence_parallel=False, commshift=False, bucket_size_bytes=100 * 2**20),
    BASE.replace(recompute_layers=("full",) * 4 + ("none",) * 4, param_cache=("device",) * 4 + ("secondary",) * 4,
                 prefetch_depth=3),
])
def test_trial_parameters_round_trip(problem, plan):
    params = base_params(plan, problem)
    assert plan_from_trial(optuna.trial.FixedTrial(params), plan, problem) == plan


def test_second_call_continues_the_same_study(problem, tmp_path):
    storage = f"sqlite:///{tmp_path / 'tune.db'}"
    first = refine_with_optuna(problem, base=BASE, num_trials=6, storage=storage, study_name="resume", seed=1)
    second = refine_with_optuna(problem, base=BASE, num_trials=4, storage=storage, study_name="resume", seed=1)
    assert (first.num_trials, second.num_trials, second.num_new_trials) == (6, 10, 4)
    # The study remembers the best plan so far: resuming can only keep or improve it.
    assert second.best.estimate.step_time_s <= first.best.estimate.step_time_s


def test_fixed_seed_is_reproducible_and_never_worse_than_the_base(problem):
    a = refine_with_optuna(problem, base=BASE, num_trials=12, seed=3)
    b = refine_with_optuna(problem, base=BASE, num_trials=12, seed=3)
    assert a.best.plan == b.best.plan
    base_est = estimate(BASE, model=problem.model, cluster=problem.cluster, job=problem.job)
    # The base plan is the study's first trial, so the best can only be as fast or faster.
    assert base_est.fits and a.best.estimate.step_time_s <= base_est.step_time_s
    assert a.best.estimate.fits


def test_bad_storage_is_one_planner_error(problem, tmp_path):
    from specs.errors import PlannerError

    with pytest.raises(PlannerError, match="--storage"):
        refine_with_optuna(problem, base=BASE, num_trials=1, storage="nosuchdb://x")
