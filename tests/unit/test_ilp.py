"""The ILPs against brute force on small random instances: they must find the same optimum."""

import itertools
import random

import pytest

from specs.errors import PlannerError
from planner.ilp import (POLICIES, StageCosts, _bottleneck, balance_stages, choose_recompute,
                         layout_bottleneck_s, layout_memory_bytes, partition_layers)


def compositions(total: int, parts: int, minimum: int = 1):
    """All ways to write `total` as an ordered sum of `parts` integers >= minimum."""
    if parts == 1:
        if total >= minimum:
            yield (total,)
        return
    for first in range(minimum, total - minimum * (parts - 1) + 1):
        for rest in compositions(total - first, parts - 1, minimum):
            yield (first,) + rest


def test_compositions_helper_counts():
    # C(n-1, k-1) compositions of n into k positive parts; C(n+k-1, k-1) with zeros allowed.
    assert len(list(compositions(6, 3))) == 10
    assert len(list(compositions(4, 3, minimum=0))) == 15


def _partition_memory(counts, state, act, in_flight, pp, first_b, last_b):
    rank_bytes, start = [0.0] * pp, 0
    for c, n in enumerate(counts):
        rank_bytes[c % pp] += sum(state[i] + in_flight[c] * act[i] for i in range(start, start + n))
        start += n
    rank_bytes[0] += first_b
    rank_bytes[(len(counts) - 1) % pp] += last_b
    return rank_bytes


@pytest.mark.parametrize("seed", range(12))
def test_partition_layers_matches_brute_force(seed):
    rng = random.Random(seed)
    num_layers = rng.randint(3, 8)
    pp = rng.randint(2, 3)
    v = rng.choice([1, 2]) if num_layers >= 2 * pp else 1
    chunks = pp * v
    times = [rng.uniform(0.5, 2.0) for _ in range(num_layers)]
    state = [rng.uniform(1, 3) for _ in range(num_layers)]
    act = [rng.uniform(0.5, 2) for _ in range(num_layers)]
    in_flight = [rng.randint(1, 3) for _ in range(chunks)]
    first_t, last_t, first_b, last_b = rng.uniform(0, 2), rng.uniform(0, 2), rng.uniform(0, 3), rng.uniform(0, 3)
    # A cap between the most and least memory-hungry split makes the memory constraints bind.
    splits = list(compositions(num_layers, chunks))
    peaks = sorted(max(_partition_memory(s, state, act, in_flight, pp, first_b, last_b)) for s in splits)
    cap = peaks[len(peaks) // 3]
    best = min(_bottleneck(list(s), times, pp, first_t, last_t) for s in splits
               if max(_partition_memory(s, state, act, in_flight, pp, first_b, last_b)) <= cap)
    got = partition_layers(layer_time_s=times, layer_state_bytes=state, layer_activation_bytes=act, pp=pp,
                           num_chunks=chunks, in_flight=in_flight, memory_cap_bytes=cap, first_extra_time_s=first_t,
                           last_extra_time_s=last_t, first_extra_bytes=first_b, last_extra_bytes=last_b)
    assert sum(got.chunk_layers) == num_layers and min(got.chunk_layers) >= 1
    assert max(_partition_memory(list(got.chunk_layers), state, act, in_flight, pp, first_b, last_b)) <= cap * (1 + 1e-6)
    assert got.bottleneck_time_s == pytest.approx(best, rel=1e-6)


def test_partition_layers_balances_head_and_embedding():
    # 8 equal layers on 2 ranks, the head costs two layers: the last rank must take 3 layers, not 4.
    got = partition_layers(layer_time_s=[1.0] * 8, layer_state_bytes=[0.0] * 8, layer_activation_bytes=[0.0] * 8,
                           pp=2, num_chunks=2, in_flight=[1, 1], memory_cap_bytes=1.0, last_extra_time_s=2.0)
    assert got.chunk_layers == (5, 3) and got.bottleneck_time_s == 5.0


@pytest.mark.parametrize("seed", range(12))
def test_choose_recompute_matches_brute_force(seed):
    rng = random.Random(100 + seed)
    num_layers = rng.randint(2, 7)
    time_s, mem = [], []
    for _ in range(num_layers):
        base_t, base_m = rng.uniform(1, 2), rng.uniform(1, 4)
        # Recomputing costs time and saves memory, by random amounts per layer.
        time_s.append({"none": base_t, "selective": base_t * rng.uniform(1.0, 1.1), "full": base_t * rng.uniform(1.2, 1.4)})
        mem.append({"none": base_m, "selective": base_m * rng.uniform(0.3, 0.8), "full": base_m * rng.uniform(0.05, 0.2)})
    combos = list(itertools.product(POLICIES, repeat=num_layers))
    mems = sorted(sum(mem[i][p] for i, p in enumerate(c)) for c in combos)
    cap = mems[len(mems) // 2]
    best = min(sum(time_s[i][p] for i, p in enumerate(c)) for c in combos
               if sum(mem[i][p] for i, p in enumerate(c)) <= cap)
    got = choose_recompute(time_s=time_s, memory_bytes=mem, memory_cap_bytes=cap)
    assert got.memory_bytes <= cap * (1 + 1e-6)
    assert got.time_s == pytest.approx(best, rel=1e-6)


def _random_stage_costs(rng: random.Random) -> tuple[StageCosts, list]:
    num_layers = rng.randint(3, 7)
    pp = rng.randint(1, 3)
    v = 2 if num_layers >= 2 * pp and pp > 1 and rng.random() < 0.4 else 1
    t = rng.uniform(1, 2)
    a = rng.uniform(1, 3)
    costs = StageCosts(
        num_layers=num_layers, pp=pp, num_chunks=pp * v,
        time_s={"none": t, "selective": t * rng.uniform(1.02, 1.1), "full": t * rng.uniform(1.25, 1.4)},
        activation_bytes={"none": a, "selective": a * rng.uniform(0.3, 0.7), "full": a * rng.uniform(0.05, 0.15)},
        state_bytes=rng.uniform(0.5, 2), in_flight=tuple(rng.randint(1, 4) for _ in range(pp * v)),
        memory_cap_bytes=1.0, first_extra_time_s=rng.uniform(0, 2), last_extra_time_s=rng.uniform(0, 3),
        first_extra_bytes=rng.uniform(0, 3), last_extra_bytes=rng.uniform(0, 3))
    layouts = []
    for split in compositions(num_layers, costs.num_chunks):
        per_chunk = [[dict(zip(POLICIES, k)) for k in compositions(n, 3, minimum=0)] for n in split]
        layouts.extend(list(choice) for choice in itertools.product(*per_chunk))
    return costs, layouts


@pytest.mark.parametrize("seed", range(15))
def test_balance_stages_matches_brute_force(seed):
    rng = random.Random(200 + seed)
    costs, layouts = _random_stage_costs(rng)
    peaks = sorted(max(layout_memory_bytes(costs, lay)) for lay in layouts)
    cap = peaks[rng.randint(0, len(peaks) // 2)]
    costs = StageCosts(**{**costs.__dict__, "memory_cap_bytes": cap})
    best = min(layout_bottleneck_s(costs, lay) for lay in layouts if max(layout_memory_bytes(costs, lay)) <= cap)
    got = balance_stages(costs)
    assert sum(got.stage_layers) == costs.num_layers == len(got.recompute_layers)
    # Re-derive the counts from the per-layer output and check memory and time independently.
    counts, start = [], 0
    for n in got.stage_layers:
        chunk = got.recompute_layers[start:start + n]
        counts.append({p: chunk.count(p) for p in POLICIES})
        start += n
    assert max(layout_memory_bytes(costs, counts)) <= cap * (1 + 1e-6)
    # The tie-break term is at most 1e-4 of the bottleneck scale.
    assert got.bottleneck_time_s == pytest.approx(best, rel=2e-4)


def test_balance_stages_recomputes_only_what_memory_forces():
    # One stage, 4 layers, a 22-byte cap: none,none,full,full (22 bytes, 4.6 s) fits, but three
    # selective and one full (19 bytes, 4.45 s) is faster; all four selective (24 bytes) does not fit.
    costs = StageCosts(num_layers=4, pp=1, num_chunks=1, time_s={"none": 1.0, "selective": 1.05, "full": 1.3},
                       activation_bytes={"none": 10.0, "selective": 6.0, "full": 1.0}, state_bytes=0.0,
                       in_flight=(1,), memory_cap_bytes=22.0)
    got = balance_stages(costs)
    assert got.recompute_layers == ("selective", "selective", "selective", "full")
    assert got.bottleneck_time_s == pytest.approx(4.45)


def test_infeasible_cap_is_a_planner_error():
    costs = StageCosts(num_layers=2, pp=1, num_chunks=1, time_s=dict.fromkeys(POLICIES, 1.0),
                       activation_bytes=dict.fromkeys(POLICIES, 1.0), state_bytes=5.0, in_flight=(1,),
                       memory_cap_bytes=3.0)
    with pytest.raises(PlannerError, match="infeasible"):
        balance_stages(costs)


def test_time_limited_solve_still_returns_a_feasible_layout():
    # 96 chunks (pp 12 x v 8) of a 96-layer model with an uneven head: large and near-symmetric, the
    # case where CBC may not prove optimality quickly. Under a time limit the answer must still fit
    # and be no slower than the even split, which is feasible here.
    pp, v = 12, 8
    costs = StageCosts(num_layers=96 + 12, pp=pp, num_chunks=pp * v, time_s={"none": 1.0, "selective": 1.05, "full": 1.33},
                       activation_bytes={"none": 10.0, "selective": 6.0, "full": 1.0}, state_bytes=4.0,
                       in_flight=tuple([3] * (pp * v)), memory_cap_bytes=400.0, first_extra_time_s=0.5,
                       last_extra_time_s=3.0, first_extra_bytes=20.0, last_extra_bytes=40.0)
    got = balance_stages(costs, time_limit_s=1.0)
    counts, start = [], 0
    for n in got.stage_layers:
        chunk = got.recompute_layers[start:start + n]
        counts.append({p: chunk.count(p) for p in POLICIES})
        start += n
    assert sum(got.stage_layers) == costs.num_layers and min(got.stage_layers) >= 1
    assert max(layout_memory_bytes(costs, counts)) <= costs.memory_cap_bytes * (1 + 1e-6)
    even = [{"none": 1} for _ in range(pp * v)]
    for c in range(12):  # the 12 extra layers go one each to the middle chunks, all without recomputation
        even[1 + c]["none"] += 1
    assert max(layout_memory_bytes(costs, even)) <= costs.memory_cap_bytes
    assert got.bottleneck_time_s <= layout_bottleneck_s(costs, even) + 1e-9
