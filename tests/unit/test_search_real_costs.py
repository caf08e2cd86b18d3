"""The search's bounds hold for the real cost model, and the search then agrees with brute force."""

import random

import pytest

from cost_models.estimate import estimate, layer_costs, step_time_lower_bound_s
from specs.problem import make_problem
from planner.search import (SearchOptions, default_cost_model, enumerate_slots, search, sharding_variants,
                            slot_memory, time_lower_bound_s)

PROBLEMS = {
    "tiny-8-cpu": dict(model="tiny", hardware="cpu", gpus=8, gpus_per_node=4, global_batch=32, seq_len=64),
    "gpt3-18b-64-a100": dict(model="gpt3-18b", hardware="a100", gpus=64, gpus_per_node=8, global_batch=128, seq_len=2048),
    "llama3-70b-128-h100": dict(model="llama3-70b", hardware="h100", gpus=128, gpus_per_node=8, global_batch=256, seq_len=4096),
    "llama3.1-8b-64-h100-cp": dict(model="llama3.1-8b", hardware="h100", gpus=64, gpus_per_node=8, global_batch=8,
                                   seq_len=65536),
    "mixtral-8x7b-32-h100": dict(model="mixtral-8x7b", hardware="h100", gpus=32, gpus_per_node=8, global_batch=64,
                                 seq_len=4096),
}
# Every engine's pricing, DeepSpeed's reduction after the pipeline drains included.
ENGINES = {"tiny-8-cpu": "ours", "gpt3-18b-64-a100": "deepspeed", "llama3-70b-128-h100": "megatron",
           "llama3.1-8b-64-h100-cp": "torchtitan", "mixtral-8x7b-32-h100": "ours"}


@pytest.mark.parametrize("name", list(PROBLEMS))
def test_bounds_never_exceed_the_cost_model(name):
    """The slot's bound and each variant's own (`step_time_lower_bound_s`) stay at or below the estimate,
    and the slot's layer costs handed to the estimate give exactly the estimate that computes its own."""
    problem = make_problem(**PROBLEMS[name])
    engine = ENGINES[name]
    kwargs = dict(model=problem.model, cluster=problem.cluster, job=problem.job, engine=engine)
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
            assert estimate(plan, **kwargs, costs=costs) == est, plan.describe()
            assert bound_s <= est.step_time_s * (1 + 1e-9), plan.describe()
            variant_s = step_time_lower_bound_s(plan, **kwargs, costs=costs)
            assert bound_s * (1 - 1e-9) <= variant_s <= est.step_time_s * (1 + 1e-9), plan.describe()
            assert memory.lower_bound_bytes(shards, problem.job.precision) <= est.peak_memory_bytes, plan.describe()


def _ranking(result, k):
    return [(c.plan, c.estimate.step_time_s) for c in result.candidates if c.estimate.fits][:k]


@pytest.mark.parametrize("name,engine", [("tiny-8-cpu", "ours"), ("llama3-8b-8-h100", "megatron")])
def test_search_with_the_ilps_ranks_as_brute_force(name, engine):
    """The ILPs start from the best few fitting plans of a kind (`_BranchAndBound.need_s`), which may lie
    below the top k; the pruned search must hand them the same seeds as pricing every plan does, so the
    whole ranked top k (ILP results included) is the exhaustive search's."""
    setting = PROBLEMS.get(name) or dict(model="llama3-8b", hardware="h100", gpus=8, gpus_per_node=8,
                                         global_batch=32, seq_len=8192)
    problem = make_problem(**setting)
    cost = default_cost_model(engine)
    # The exhaustive search prices every plan and seeds the ILPs from all of them, whatever its k.
    exact = search(problem, options=SearchOptions(exhaustive=True, top_k=5), cost=cost)
    for k in (1, 5):
        got = search(problem, options=SearchOptions(top_k=k), cost=cost)
        assert _ranking(got, k) == _ranking(exact, k)
        assert got.bound_violations == 0 and exact.bound_violations == 0
        assert got.num_evaluated < exact.num_evaluated / 3


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
