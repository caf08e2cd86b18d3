"""The search's bounds hold for the real cost model, and the search then agrees with brute force."""

import random

import pytest

from cost_models.estimate import estimate, layer_costs
from specs.problem import make_problem
from planner.search import (SearchOptions, enumerate_slots, search, sharding_variants, slot_memory,
                            time_lower_bound_s)

PROBLEMS = {
    "tiny-8-cpu": dict(model="tiny", hardware="cpu", gpus=8, gpus_per_node=4, global_batch=32, seq_len=64),
    "gpt3-18b-64-a100": dict(model="gpt3-18b", hardware="a100", gpus=64, gpus_per_node=8, global_batch=128, seq_len=2048),
    "llama3-70b-128-h100": dict(model="llama3-70b", hardware="h100", gpus=128, gpus_per_node=8, global_batch=256, seq_len=4096),
}


@pytest.mark.parametrize("name", list(PROBLEMS))
def test_bounds_never_exceed_the_cost_model(name):
    problem = make_problem(**PROBLEMS[name])
    kwargs = dict(model=problem.model, cluster=problem.cluster, job=problem.job)
    slots = list(enumerate_slots(problem, SearchOptions()))
    rng = random.Random(0)
    for slot in rng.sample(slots, min(60, len(slots))):
        costs = layer_costs(slot.plan(), **kwargs)
        bound_s = time_lower_bound_s(slot, costs, num_layers=problem.model.num_layers)
        memory = slot_memory(slot, costs, problem)
        variants = sharding_variants(slot, devices_per_node=problem.cluster.devices_per_node)
        for shards, cache, shift in rng.sample(variants, min(4, len(variants))):
            plan = slot.plan(shards=shards, cache=cache, commshift=shift)
            est = estimate(plan, **kwargs)
            assert bound_s <= est.step_time_s * (1 + 1e-9), plan.describe()
            assert memory.lower_bound_bytes(shards, problem.job.precision) <= est.peak_memory_bytes, plan.describe()


def test_search_matches_brute_force_with_the_real_cost_model():
    problem = make_problem(**PROBLEMS["tiny-8-cpu"])
    exact = search(problem, options=SearchOptions(exhaustive=True, use_ilp=False, top_k=1))
    got = search(problem, options=SearchOptions(top_k=3, use_ilp=False))
    assert got.winner.estimate.step_time_s == exact.winner.estimate.step_time_s
    assert got.num_evaluated < exact.num_evaluated / 5
    assert got.bound_violations == 0


def test_search_finds_a_fitting_plan_for_a_large_model():
    problem = make_problem(**PROBLEMS["llama3-70b-128-h100"])
    result = search(problem, options=SearchOptions(top_k=3))
    assert result.winner.estimate.fits and result.bound_violations == 0
    # 70B parameters need their 16 bytes each spread over many devices; any fitting plan shards them.
    plan = result.winner.plan
    assert plan.tp * plan.pp * plan.optim_shard >= 16
    # The Pareto front starts at the least memory any priced plan needs and ends at the winner's speed.
    assert result.pareto[-1].estimate.step_time_s == result.winner.estimate.step_time_s
