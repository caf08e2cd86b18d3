"""Lins, MAZ3 and Commshift in the cost model and the search: the Lins space, the choice of a non-ZeRO
point on a slow inter-node link, the MAZ3 tier ILP against brute force, each tier's price, and
Commshift moving the last micro-batch's reduce-scatter and all-reduce off the critical path."""

import dataclasses

from cost_models.memory import ALLOCATOR_FRAGMENTATION
import itertools
import random

import pytest

from cost_models import estimate as est
from cost_models.estimate import cache_cost_inputs, estimate
from cost_models.timeline import ChunkDurations, simulate
from specs.cluster import Cluster
from planner.ilp import CACHE_TIERS, CacheCosts, cache_exposed_s, cache_fits, choose_param_cache
from specs.problem import Problem
from specs.job import Job
from specs.model import PRESETS
from specs.plan import Plan
from planner.search import SearchOptions, lins_points, search
from specs.hardware import PRESETS as HW

LLAMA8 = PRESETS["llama3-8b"]
GIB = 1024**3


def _slow_inter_node(*, memory_bytes=None, inter_bytes_per_s=1e9):
    hw = HW["h100"]
    hw = dataclasses.replace(hw, inter_node=dataclasses.replace(hw.inter_node, bandwidth_bytes_per_s=inter_bytes_per_s))
    return dataclasses.replace(hw, memory_bytes=memory_bytes) if memory_bytes else hw


def _price(plan, cluster, *, seq_len=4096, model=LLAMA8):
    return estimate(plan, model=model, cluster=cluster, job=Job(global_batch=plan.global_batch, seq_len=seq_len))


# --- Lins ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dp,per_node", [(4, 2), (8, 4), (16, 8), (12, 8), (32, 8), (6, 6), (8, 1)])
def test_lins_points_are_exactly_the_rule(dp, per_node):
    def fills(d):  # inside one node, or whole nodes; 1 and dp (ZeRO) always
        return d in (1, dp) or per_node % d == 0 or d % per_node == 0

    want = {(a, b, c) for a, b, c in itertools.product(range(1, dp + 1), repeat=3)
            if dp % c == 0 and c % b == 0 and b % a == 0 and b in (a, c) and all(map(fills, (a, b, c)))}
    got = lins_points(dp, dp_per_node=per_node)
    assert len(got) == len(set(got)) and set(got) == want
    # ZeRO-0..3 are always in; HSDP inside a node too.
    assert {(1, 1, 1), (1, 1, dp), (1, dp, dp), (dp, dp, dp)} <= set(got)
    if dp > per_node > 1 and dp % per_node == 0:
        assert (per_node, per_node, per_node) in got and (per_node, per_node, dp) in got


def test_lins_points_skip_groups_that_straddle_nodes():
    # 12 DP ranks, 8 per node: a group of 3 or 6 would cut across a node boundary.
    degrees = {d for point in lins_points(12, dp_per_node=8) for d in point}
    assert degrees == {1, 2, 4, 12}


def test_lins_mix_costs_less_inter_node_time_than_zero3_and_less_memory_than_hsdp():
    cluster = Cluster(num_nodes=4, devices_per_node=8, hardware=_slow_inter_node())
    plans = {s: Plan(dp=32, num_micro_batches=8, param_shard=s[0], grad_shard=s[1], optim_shard=s[2])
             for s in [(8, 8, 32), (32, 32, 32), (8, 8, 8)]}
    lins, zero3, hsdp = (_price(p, cluster) for p in plans.values())
    # Gathers and reduce-scatters stay in the node; only the boundary all-reduce and the
    # redistribution cross it, once per step instead of every micro-batch.
    assert lins.step_time_s < 0.5 * zero3.step_time_s
    # Optimizer states sharded over all 32: 12 P (1/8 - 1/32) bytes fewer than HSDP.
    p = est.layer_params_per_device(LLAMA8, tp=1) * LLAMA8.num_layers + sum(est.end_params_per_device(LLAMA8, tp=1, pp=1))
    assert hsdp.breakdown["optimizer_bytes"] - lins.breakdown["optimizer_bytes"] == pytest.approx(12 * p * (1 / 8 - 1 / 32))


def test_search_picks_a_lins_point_on_a_slow_inter_node_link():
    """2 nodes x 4 GPUs at 1 GB/s between nodes, all 8 in data parallelism, memory too small for HSDP
    (4, 4, 4) in any form: the winner shards parameters and gradients inside the node and the optimizer states
    over all of DP, s_p = s_g = 4 < s_os = 8, which no ZeRO stage (one degree for all) expresses."""
    model = dataclasses.replace(LLAMA8, num_layers=8)
    job = Job(global_batch=64, seq_len=4096)
    probe = Cluster(num_nodes=2, devices_per_node=4, hardware=_slow_inter_node())
    # The leanest layout of each point (one sequence per micro-batch, full recomputation) sets the cap.
    lins_plan = Plan(dp=8, micro_batch=1, num_micro_batches=8, recompute="full", param_shard=4, grad_shard=4,
                     optim_shard=8)
    need = estimate(lins_plan, model=model, cluster=probe, job=job).peak_memory_bytes
    hsdp = estimate(lins_plan.replace(optim_shard=4), model=model, cluster=probe, job=job).peak_memory_bytes
    assert need < hsdp
    cluster = Cluster(num_nodes=2, devices_per_node=4, hardware=_slow_inter_node(memory_bytes=(need + hsdp) // 2))
    options = SearchOptions(top_k=3, degrees=(8, 1, 1))
    result = search(Problem(model=model, cluster=cluster, job=job), options=options)
    winner = result.winner.plan
    assert winner.zero_level is None, winner.describe()
    assert winner.shard_degrees == (4, 4, 8), winner.describe()
    # ...and it beats every ZeRO plan, priced exhaustively.
    every = search(Problem(model=model, cluster=cluster, job=job),
                   options=dataclasses.replace(options, exhaustive=True, use_ilp=False))
    zero = [c for c in every.candidates if c.plan.zero_level is not None and c.estimate.fits]
    assert zero and result.winner.estimate.step_time_s < min(c.estimate.step_time_s for c in zero)


def test_redistribution_overlaps_the_next_forward():
    cluster = Cluster(num_nodes=2, devices_per_node=8, hardware=HW["h100"])
    plan = Plan(dp=16, num_micro_batches=4, param_shard=8, grad_shard=8, optim_shard=16)
    chunks = est._chunk_prices(plan, est.layer_costs(plan, model=LLAMA8, cluster=cluster, job=Job(global_batch=64, seq_len=4096)),
                               cluster, model=LLAMA8, job=Job(global_batch=64, seq_len=4096))
    exposed, total = est._redistribute_s(plan, cluster, num_params=chunks[0].num_params, param_bytes=2,
                                         first_chunk=chunks[0])
    # ~2 GB over 2 ranks across nodes: far longer than one bucket, shorter than a forward's compute.
    one_bucket = est.collective_time_s(cluster, collective="all_gather", size_bytes=plan.bucket_size_bytes,
                                       group_size=2, stride=8)
    assert total > 10 * one_bucket
    assert exposed == pytest.approx(one_bucket)
    # Without a forward to hide behind, all of it is exposed.
    bare = dataclasses.replace(chunks[0], forward_compute_s=0.0)
    assert est._redistribute_s(plan, cluster, num_params=chunks[0].num_params, param_bytes=2,
                               first_chunk=bare)[0] == pytest.approx(total)


# --- MAZ3 ------------------------------------------------------------------------------------------------
def _random_cache_costs(rng: random.Random, num_layers: int, pp: int) -> CacheCosts:
    num_chunks = pp * rng.choice([1, 2]) if num_layers >= 2 * pp else pp
    bounds = sorted(rng.sample(range(1, num_layers), num_chunks - 1))
    layer_chunk = tuple(next(c for c, b in enumerate(bounds + [num_layers]) if i < b) for i in range(num_layers))
    fetch, extra, dev, host = [], [], [], []
    for _ in range(num_layers):
        gather = rng.uniform(0.5, 2.0)
        size = rng.uniform(1.0, 3.0)
        fetch.append({"none": gather, "device": 0.0, "host": rng.uniform(0.2, 3.0), "secondary": gather * rng.uniform(0.1, 0.9)})
        extra.append({"none": 0.0, "device": 0.0, "host": fetch[-1]["host"], "secondary": 0.0})
        dev.append({"none": 0.0, "device": size, "host": 0.0, "secondary": size / rng.choice([2, 4, 8])})
        host.append({"none": 0.0, "device": 0.0, "host": size, "secondary": 0.0})
    return CacheCosts(
        fetch_s=tuple(fetch), forward_extra_s=tuple(extra), device_bytes=tuple(dev), host_bytes=tuple(host),
        layer_chunk=layer_chunk, pp=pp, backward_window_s=tuple(rng.uniform(0.0, 4.0) for _ in range(num_chunks)),
        forward_window_s=tuple(rng.uniform(-0.5, 3.0) for _ in range(num_chunks)),
        num_micro_batches=rng.choice([1, 4]), device_cap_bytes=tuple(rng.uniform(0.0, 6.0) for _ in range(pp)),
        host_cap_bytes=tuple(rng.uniform(0.0, 6.0) for _ in range(pp)))


@pytest.mark.parametrize("seed", range(12))
def test_cache_ilp_equals_brute_force(seed):
    rng = random.Random(seed)
    costs = _random_cache_costs(rng, num_layers=rng.choice([2, 3, 4, 5]), pp=rng.choice([1, 2]))
    feasible = [t for t in itertools.product(CACHE_TIERS, repeat=len(costs.layer_chunk)) if cache_fits(costs, t)]
    best = min(cache_exposed_s(costs, t) for t in feasible)  # all-"none" always fits
    choice = choose_param_cache(costs)
    assert cache_fits(costs, choice.tiers)
    assert choice.exposed_comm_s == pytest.approx(best, rel=1e-6, abs=1e-9)


def test_cache_ilp_fills_memory_with_device_copies_first_and_spills_to_host():
    # 4 layers, gathers fully exposed (no window), host copies cheaper than gathers and hidden in forward.
    fetch = {"none": 1.0, "device": 0.0, "host": 0.5, "secondary": 0.8}
    costs = CacheCosts(
        fetch_s=(fetch,) * 4, forward_extra_s=({"none": 0.0, "device": 0.0, "host": 0.5, "secondary": 0.0},) * 4,
        device_bytes=({"none": 0.0, "device": 1.0, "host": 0.0, "secondary": 0.25},) * 4,
        host_bytes=({"none": 0.0, "device": 0.0, "host": 1.0, "secondary": 0.0},) * 4,
        layer_chunk=(0, 0, 0, 0), pp=1, backward_window_s=(0.0,), forward_window_s=(10.0,), num_micro_batches=1,
        device_cap_bytes=(2.25,), host_cap_bytes=(1.0,))
    tiers = choose_param_cache(costs).tiers
    assert sorted(tiers) == ["device", "device", "host", "secondary"]
    # No room anywhere: nothing is kept.
    tight = dataclasses.replace(costs, device_cap_bytes=(0.0,), host_cap_bytes=(0.0,))
    assert choose_param_cache(tight).tiers == ("none",) * 4


def test_cache_tiers_priced_as_the_engine_runs_them():
    cluster = Cluster(num_nodes=2, devices_per_node=8, hardware=_slow_inter_node())
    base = Plan(dp=16, num_micro_batches=4, param_shard=16, grad_shard=16, optim_shard=16)
    priced = {t: _price(base.replace(param_cache=t), cluster) for t in CACHE_TIERS}
    layer_bytes = est.layer_params_per_device(LLAMA8, tp=1) * 2
    # device: one kept copy per layer (all layers of the chunk in flight at the peak), no backward gather.
    extra = priced["device"].breakdown["param_cache_bytes"]
    assert extra == pytest.approx(LLAMA8.num_layers * layer_bytes)
    # The kept copies come and go with the step: the allocator's fragmentation share rides on them too.
    grown = extra * (1 + ALLOCATOR_FRAGMENTATION)
    assert priced["device"].peak_memory_bytes - priced["none"].peak_memory_bytes == pytest.approx(grown, rel=1e-6)
    # secondary: the node's 8 ranks of the 16-rank group each keep 1/8.
    assert priced["secondary"].breakdown["param_cache_bytes"] == pytest.approx(extra / 8)
    # host: nothing on the device, the copy in host memory.
    assert priced["host"].peak_memory_bytes == priced["none"].peak_memory_bytes
    assert priced["host"].host_memory_bytes == pytest.approx(LLAMA8.num_layers * layer_bytes, rel=1e-6)
    # Per micro-batch, device drops one all-gather of every layer (the backward one).
    gather = est.collective_time_s(cluster, collective="all_gather", size_bytes=layer_bytes, group_size=16, stride=1)
    saved = priced["none"].breakdown["dp_comm_s"] - priced["device"].breakdown["dp_comm_s"]
    assert saved == pytest.approx(4 * LLAMA8.num_layers * gather, rel=1e-6)
    # On a slow inter-node link, skipping the cross-node backward gather makes the step faster.
    assert priced["device"].step_time_s < priced["secondary"].step_time_s < priced["none"].step_time_s


def test_host_tier_must_fit_host_memory():
    hw = dataclasses.replace(HW["h100"], host_memory_bytes=GIB)
    cluster = Cluster(num_nodes=2, devices_per_node=8, hardware=hw)
    plan = Plan(dp=16, num_micro_batches=4, param_shard=16, grad_shard=16, optim_shard=16, param_cache="host")
    priced = _price(plan, cluster)
    assert priced.host_memory_bytes > GIB and not priced.fits
    assert priced.to_dict()["fits"] is False


def test_cache_cost_inputs_match_the_estimate():
    """The ILP's inputs are the estimate's own per-tier prices: a fully hidden window is 0 exposed."""
    cluster = Cluster(num_nodes=2, devices_per_node=8, hardware=_slow_inter_node())
    plan = Plan(dp=16, num_micro_batches=4, param_shard=16, grad_shard=16, optim_shard=16)
    job = Job(global_batch=64, seq_len=4096)
    inputs = cache_cost_inputs(plan, model=LLAMA8, cluster=cluster, job=job)
    layer_bytes = est.layer_params_per_device(LLAMA8, tp=1) * 2
    # What the estimate charges a kept copy on a GPU: the layer and the allocator's fragmentation share.
    assert inputs.device_bytes["device"] == pytest.approx(layer_bytes * (1 + ALLOCATOR_FRAGMENTATION))
    assert inputs.host_bytes["host"] == layer_bytes
    assert inputs.fetch_s["none"] == pytest.approx(est.collective_time_s(
        cluster, collective="all_gather", size_bytes=layer_bytes, group_size=16, stride=1))
    assert inputs.chunk_layers == (LLAMA8.num_layers,)


def test_search_mixes_tiers_per_layer_when_memory_allows_only_some_copies():
    """Room for about half the layers' device copies: the ILP keeps some layers on the device and the
    rest gathered again or in a cheaper tier; the mix beats every uniform tier that fits."""
    model = dataclasses.replace(LLAMA8, num_layers=8)
    job = Job(global_batch=16, seq_len=1024, memory_headroom=0.0)
    probe = Cluster(num_nodes=2, devices_per_node=8, hardware=_slow_inter_node())
    plan = Plan(dp=16, num_micro_batches=1, param_shard=16, grad_shard=16, optim_shard=16)
    plain = estimate(plan, model=model, cluster=probe, job=job)
    layer_bytes = est.layer_params_per_device(model, tp=1) * 2
    hw = _slow_inter_node(memory_bytes=int(plain.peak_memory_bytes + 4.5 * layer_bytes))
    hw = dataclasses.replace(hw, host_memory_bytes=0)  # no host room: device, secondary or none
    problem = Problem(model=model, cluster=Cluster(num_nodes=2, devices_per_node=8, hardware=hw), job=job)
    inputs = cache_cost_inputs(plan, model=model, cluster=problem.cluster, job=job)
    from planner.search import _cache_ilp_inputs

    choice = choose_param_cache(_cache_ilp_inputs(plan, inputs, problem, device_cap_bytes=4.5 * layer_bytes))
    assert 1 <= choice.tiers.count("device") <= 4 and "host" not in choice.tiers
    mixed = estimate(plan.replace(param_cache=choice.tiers), model=model, cluster=problem.cluster, job=job)
    assert mixed.fits
    for tier in CACHE_TIERS:
        uniform = estimate(plan.replace(param_cache=tier), model=model, cluster=problem.cluster, job=job)
        assert not uniform.fits or mixed.step_time_s <= uniform.step_time_s * (1 + 1e-9)


# --- Commshift -------------------------------------------------------------------------------------------
def test_commshift_moves_the_last_reduce_scatter_and_all_reduce():
    """ZeRO-2-style plan with pp 2: with commshift the last backward no longer carries its reduce-scatter,
    and the step-end reduction on the communication stream is the reduce-scatter plus the all-reduce."""
    cluster = Cluster(num_nodes=4, devices_per_node=2, hardware=_slow_inter_node(inter_bytes_per_s=5e9))
    plan = Plan(dp=4, pp=2, num_micro_batches=8, param_shard=1, grad_shard=2, optim_shard=4)
    job = Job(global_batch=32, seq_len=2048)
    costs = est.layer_costs(plan, model=LLAMA8, cluster=cluster, job=job)
    chunks = est._chunk_prices(plan, costs, cluster, model=LLAMA8, job=job)
    for c in chunks:
        assert c.comm.rs_s > 0 and c.reduce_s > 0
        assert c.shift_reduce_s == pytest.approx(c.comm.rs_s + c.reduce_s)
        # Without its reduce-scatter the last backward loses the exposed last bucket and the hideable
        # rest's toll on the compute beside it (the SMs it holds, see estimate._overlap).
        e = costs.overlap_efficiency_backward
        with_rs = est._overlap(c.backward_compute_s, c.comm.bwd_rest_s + c.comm.rs_hideable_s, cluster, efficiency=e)
        without_rs = est._overlap(c.backward_compute_s, c.comm.bwd_rest_s, cluster, efficiency=e)
        assert c.shift_backward_s == pytest.approx(c.backward_s - c.comm.rs_last_s - (with_rs - without_rs))
    without = estimate(plan, model=LLAMA8, cluster=cluster, job=job)
    shifted = estimate(plan.replace(commshift=True), model=LLAMA8, cluster=cluster, job=job)
    assert shifted.breakdown["dp_comm_s"] == pytest.approx(without.breakdown["dp_comm_s"])


def test_timeline_under_commshift_uses_the_last_backward_without_its_reductions():
    pp, m = 2, 4
    d = ChunkDurations(forward_s=(1.0, 1.0), backward_s=(2.0, 2.0), p2p_s=0.0, reduce_s=(3.0, 3.0),
                       last_bucket_s=(0.5, 0.5), shift_backward_s=(1.5, 1.5))
    on = simulate(schedule="1f1b", pp=pp, virtual_stages=1, num_micro_batches=m, durations=d, commshift=True)
    off = simulate(schedule="1f1b", pp=pp, virtual_stages=1, num_micro_batches=m, durations=d, commshift=False)
    # 1F1B, pp 2, m 4, f 1, b 2: rank 0 ends at (m + pp - 1)(f + b) = 15 with plain backwards. Its last
    # backward waits for rank 1's last: under commshift each is 0.5 shorter (15 - 1); without, each
    # carries its reduction, max(2, 3 - 0.5) + 0.5 = 3, one longer (15 + 2).
    assert on.compute_end_s[0] == pytest.approx(15.0 - 1.0)
    assert off.compute_end_s[0] == pytest.approx(15.0 + 2.0)
    assert on.comm_end_s[0] == pytest.approx(on.compute_end_s[0] + 3.0)


def test_device_tier_gathers_forward_only_when_nothing_is_in_flight():
    """1F1B, pp 2, m 4: rank 0 keeps a micro-batch of its chunk in flight from its first forward to its
    last backward (one forward gather per step); rank 1 alternates forward and backward (four)."""
    assert est._fresh_forwards("1f1b", 2, 1, 4) == (1, 4)
    assert est._fresh_forwards("gpipe", 2, 1, 4) == (1, 1)
    cluster = Cluster(num_nodes=2, devices_per_node=8, hardware=_slow_inter_node())
    plan = Plan(dp=8, pp=2, num_micro_batches=4, param_shard=8, grad_shard=8, optim_shard=8)
    job = Job(global_batch=32, seq_len=4096)
    costs = est.layer_costs(plan, model=LLAMA8, cluster=cluster, job=job)
    none = est._chunk_prices(plan, costs, cluster, model=LLAMA8, job=job)
    device = est._chunk_prices(plan.replace(param_cache="device"), costs, cluster, model=LLAMA8, job=job)
    gather = est.collective_time_s(cluster, collective="all_gather", size_bytes=est.layer_params_per_device(LLAMA8, tp=1) * 2,
                                   group_size=8, stride=1)
    layers = LLAMA8.num_layers // 2
    # Per micro-batch: rank 1 saves its backward gathers; rank 0 also 3 of every 4 forward gathers.
    assert none[1].dp_comm_s - device[1].dp_comm_s == pytest.approx(layers * gather, rel=1e-6)
    assert none[0].dp_comm_s - device[0].dp_comm_s == pytest.approx(layers * gather * (1 + 3 / 4), rel=1e-6)


# The benchmark's Commshift workload (benchmarks/techniques.py): 1 x 1024 x 128 fp32 activations
# (512 KiB per send), one layer per stage, pp2 x dp2 on CPU nodes with a 2.5 MB/s NIC.
CS_MODEL = dataclasses.replace(PRESETS["tiny"], name="tiny-h128-l2", hidden_size=128, num_heads=8, num_kv_heads=4,
                               ffn_hidden_size=352, num_layers=2, max_seq_len=1024)
CS_JOB = Job(global_batch=4, seq_len=1024, precision="fp32")
CS_PLAN = Plan(dp=2, pp=2, num_micro_batches=2, schedule="1f1b")


def _cs_cluster(num_nodes, per_node, *, device_type="cpu"):
    hw = HW["cpu"]
    hw = dataclasses.replace(hw, device_type=device_type,
                             inter_node=dataclasses.replace(hw.inter_node, bandwidth_bytes_per_s=2.5e6))
    return Cluster(num_nodes=num_nodes, devices_per_node=per_node, hardware=hw)


def _cs_prices(cluster, plan=CS_PLAN):
    chunks = est._chunk_prices(plan, est.layer_costs(plan, model=CS_MODEL, cluster=cluster, job=CS_JOB), cluster,
                               model=CS_MODEL, job=CS_JOB)
    durations = est._step_end_durations(plan, cluster, chunks=chunks, model=CS_MODEL, job=CS_JOB)
    return chunks, durations


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_commshift_gains_one_send_where_send_and_reduction_share_the_nic(device_type):
    """4 nodes x 1: stage 1's last input-gradient send (rank 2 -> 0) and its DP all-reduce (2 <-> 3)
    both leave rank 2's NIC. The send's wire time is 512 KiB / 2.5 MB/s = 0.2097 s; the reduction's
    (~0.9 MB of gradients, 2 ranks: each sends its size once) is longer, so sharing delays the send by
    the whole send, min(0.2097, reduction) = 0.2097 s, and the reduction by as much. With commshift the
    reduction starts one send (0.2097 s + latency) after the last backward and the send goes alone.
    Stage 0 is critical (its last backward and its own reduction follow the send), so the step is
    one send shorter. The same on GPUs: torch runs DP and PP on separate NCCL communicators."""
    cluster = _cs_cluster(4, 1, device_type=device_type)
    p2p_wire_s = 1024 * 128 * 4 / 2.5e6
    assert p2p_wire_s == pytest.approx(0.2097152)
    chunks, shared = _cs_prices(cluster)
    # (the wire part is the time beyond a 1-byte message's: 1 byte short of the send)
    assert est._p2p_wire_s(CS_PLAN, cluster, model=CS_MODEL, job=CS_JOB) == pytest.approx(p2p_wire_s, rel=1e-5)
    assert chunks[1].reduce_wire_s > p2p_wire_s
    assert shared.last_send_delay_s == pytest.approx((0.0, p2p_wire_s), rel=1e-5)
    assert shared.reduce_s[1] == pytest.approx(chunks[1].reduce_s + p2p_wire_s, rel=1e-5)
    assert shared.reduce_start_s == (0.0, 0.0)
    _, alone = _cs_prices(cluster, CS_PLAN.replace(commshift=True))
    assert alone.last_send_delay_s == (0.0, 0.0)
    assert alone.reduce_start_s == pytest.approx((0.0, shared.p2p_s))
    assert alone.reduce_s == pytest.approx((chunks[0].shift_reduce_s, chunks[1].shift_reduce_s))
    without = estimate(CS_PLAN, model=CS_MODEL, cluster=cluster, job=CS_JOB).step_time_s
    shifted = estimate(CS_PLAN.replace(commshift=True), model=CS_MODEL, cluster=cluster, job=CS_JOB).step_time_s
    assert without - shifted == pytest.approx(p2p_wire_s, rel=1e-5)


def test_commshift_gains_nothing_where_the_reduction_stays_in_the_node():
    """2 nodes x 2: the send crosses the NIC (node 1 -> node 0), the DP reduction of each stage stays in
    its node: nothing shares, the send is not delayed, and commshift only starts stage 1's reduction
    one send later, off the critical path: the same step."""
    cluster = _cs_cluster(2, 2)
    chunks, shared = _cs_prices(cluster)
    assert chunks[1].reduce_wire_s == 0.0 and shared.last_send_delay_s == (0.0, 0.0)
    _, alone = _cs_prices(cluster, CS_PLAN.replace(commshift=True))
    assert alone.reduce_start_s == pytest.approx((0.0, shared.p2p_s))
    without = estimate(CS_PLAN, model=CS_MODEL, cluster=cluster, job=CS_JOB).step_time_s
    shifted = estimate(CS_PLAN.replace(commshift=True), model=CS_MODEL, cluster=cluster, job=CS_JOB).step_time_s
    assert shifted == pytest.approx(without, rel=1e-9)


def test_the_search_picks_commshift_where_the_price_says_it_pays():
    """Among pp2 x dp2 plans of the Commshift workload: on 4 x 1 (send and reduction share the NIC) the
    winner runs commshift, on 2 x 2 (they do not) it does not; and every priced pipelined candidate
    carries the commshift setting its own price prefers (a tie keeps it off: one knob fewer)."""
    for (num_nodes, per_node), wanted in (((4, 1), True), ((2, 2), False)):
        cluster = _cs_cluster(num_nodes, per_node)
        problem = Problem(model=CS_MODEL, cluster=cluster, job=CS_JOB)
        result = search(problem, options=SearchOptions(top_k=3, degrees=(2, 1, 2)))
        assert result.winner.plan.commshift == wanted, result.winner.plan.describe()
        for cand in result.candidates[:10]:
            other = estimate(cand.plan.replace(commshift=not cand.plan.commshift), model=CS_MODEL, cluster=cluster,
                             job=CS_JOB)
            if cand is result.winner:
                assert other.step_time_s >= cand.estimate.step_time_s * (1 - 1e-9), cand.plan.describe()
