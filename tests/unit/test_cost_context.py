"""Context parallelism in the cost model: attention work split 1/cp by the balanced causal layout,
activations divided by cp, the all-to-all and ring volumes by hand (GQA's K/V heads), and the ring's
messages against the partial attention they hide behind."""

import dataclasses

import pytest

from cost_models.comm import flat_collective_time_s
from cost_models.compute import (Gemm, flash_attention_times_s, gemm_time_s, layer_compute_times, memory_time_s,
                                 ring_blocks_times_s)
from cost_models.context import context_comm, ring_steps
from cost_models.engines import ENGINES
from cost_models.estimate import collective_time_s, estimate, layer_costs
from specs.cluster import Cluster
from specs.errors import PlannerError
from specs.hardware import PRESETS as HW
from specs.hardware import CollectiveFit, LinkSpec
from specs.job import Job
from specs.model import PRESETS
from specs.plan import Plan

H100 = dataclasses.replace(HW["h100"], intra_node=LinkSpec(400e9, 5e-6), inter_node=LinkSpec(50e9, 1e-5))
NODES = Cluster(num_nodes=8, devices_per_node=8, hardware=H100)
MODEL = PRESETS["llama3.1-8b"]  # 32 heads, 8 K/V heads of 128


def test_ring_steps_hide_each_message_behind_its_partial_attention():
    # r = 4: the core splits into r + 1 = 5 half-squares; step 0 computes two of them, the others one each.
    assert ring_steps(4, send_s=1.0, core_s=5.0, gradients=False) == ((1.0, 2.0), (1.0, 1.0), (1.0, 1.0), (0.0, 1.0))
    # Backward: K/V and their gradients every step; the last gradient message has nothing to hide behind.
    assert ring_steps(4, send_s=1.0, core_s=5.0, gradients=True) == \
        ((2.0, 2.0), (2.0, 1.0), (2.0, 1.0), (0.0, 1.0), (1.0, 0.0))


def test_all_to_all_and_ring_volumes_by_hand():
    job = Job(global_batch=8, seq_len=65536, precision="bf16")
    b, s, d, p = 1, 65536, 128, 2
    # All-to-all over cp 4 with tp 2: q and the output (32 / 2 heads), k and v (8 / 2 K/V heads), s / 4 tokens.
    a2a = Plan(dp=4, tp=2, cp=4, cp_kind="all-to-all", num_micro_batches=2)
    ctx = context_comm(a2a, NODES, model=MODEL, job=job, core_forward_s=1.0, core_backward_s=2.5,
                       collective_time_s=collective_time_s)
    q, kv = b * s // 4 * 16 * d * p, b * s // 4 * 4 * d * p
    assert ctx.a2a_bytes == pytest.approx(2 * (2 * q + 2 * kv) * 3 / 4)
    expected = sum(collective_time_s(NODES, collective="all_to_all", size_bytes=x, group_size=4, stride=2)
                   for x in (q, q, kv, kv))
    assert ctx.a2a_forward_s == pytest.approx(expected) and ctx.ring_bytes == 0
    # Ring over cp 8 with tp 8: one node per CP rank, K and V of s / 8 tokens and 8 / 8 K/V heads per message,
    # r - 1 forward, r - 1 + r backward.
    ring = Plan(dp=1, tp=8, cp=8, num_micro_batches=8)
    ctx = context_comm(ring, NODES, model=MODEL, job=job, core_forward_s=1.0, core_backward_s=2.5,
                       collective_time_s=collective_time_s)
    message = 2 * b * (s // 8) * 1 * d * p
    assert ctx.ring_bytes == pytest.approx((7 + 7 + 8) * message)
    send_s = flat_collective_time_s(H100, collective="p2p", size_bytes=message, group_size=2, link="inter_node")
    assert ctx.ring_forward[0] == pytest.approx((send_s, 2 / 9))
    assert ctx.a2a_bytes == 0


def test_the_ring_is_priced_from_the_profiles_ring_step_curve_where_it_has_one():
    # A ring step (send to the next rank and receive from the previous at once) measured 3x a one-way send:
    # the ring's messages take the ring-step fit nearest its size; without one, the one-way p2p fit.
    p2p = CollectiveFit("p2p", "inter_node", 2, latency_s=1e-4, bandwidth_bytes_per_s=1e9)
    steps = [CollectiveFit("ring_step", "inter_node", n, latency_s=3e-4 * n, bandwidth_bytes_per_s=1e9 / n)
             for n in (2, 4)]
    job = Job(global_batch=8, seq_len=65536, precision="bf16")
    ring = Plan(dp=1, tp=8, cp=8, num_micro_batches=8)
    message = 2 * 1 * (65536 // 8) * 1 * 128 * 2
    for fits, expected in (((p2p,), 1e-4 + message / 1e9), ((p2p, *steps), 12e-4 + message / 0.25e9)):
        cluster = dataclasses.replace(NODES, hardware=dataclasses.replace(H100, collectives=fits))
        ctx = context_comm(ring, cluster, model=MODEL, job=job, core_forward_s=1.0, core_backward_s=2.5,
                           collective_time_s=collective_time_s)
        assert ctx.ring_forward[0][0] == pytest.approx(expected)


def test_the_context_probes_extra_seconds_join_every_message_of_the_nearest_measured_size():
    """engine_{ring,a2a}_extra_s_{c} (planner/profiling.context_message_extras) add to each ring message and
    each all-to-all; a size not measured takes the nearest measured one (the smaller on a tie), none 0; a
    negative extra never takes a message below half its curve's time."""
    from cost_models.context import message_extra_s, messages_per_layer

    calibration = {"engine_ring_extra_s_2": 1e-3, "engine_ring_extra_s_8": 3e-3, "engine_a2a_extra_s_4": 2e-3}
    assert [message_extra_s(calibration, "ring", c) for c in (2, 4, 8, 16)] == [1e-3, 1e-3, 3e-3, 3e-3]
    assert message_extra_s(calibration, "a2a", 2) == 2e-3 and message_extra_s({}, "ring", 2) == 0.0
    assert messages_per_layer("a2a", 4) == 8 and messages_per_layer("ring", 4) == 10
    job = Job(global_batch=8, seq_len=65536, precision="bf16")
    for kind, key, extra in (("ring", "engine_ring_extra_s_2", 1e-3), ("hierarchical", "engine_a2a_extra_s_2", 2e-3),
                             ("ring", "engine_ring_extra_s_2", -1.0)):
        plan = Plan(dp=1, tp=4, cp=4, cp_kind=kind, num_micro_batches=8)  # hierarchical: a2a 2 x ring 2
        plain = context_comm(plan, NODES, model=MODEL, job=job, core_forward_s=1.0, core_backward_s=2.5,
                             collective_time_s=collective_time_s)
        hardware = dataclasses.replace(H100, calibration={**H100.calibration, key: extra})
        extra_ctx = context_comm(plan, dataclasses.replace(NODES, hardware=hardware), model=MODEL, job=job,
                                 core_forward_s=1.0, core_backward_s=2.5, collective_time_s=collective_time_s)
        a2a_added = 4 * extra if "a2a" in key else 0.0
        assert extra_ctx.a2a_forward_s == pytest.approx(plain.a2a_forward_s + a2a_added)
        sent = [m for m, _ in plain.ring_forward]
        ring_added = [max(m / 2, m + extra) if m else 0.0 for m in sent] if "ring" in key else sent
        assert [m for m, _ in extra_ctx.ring_forward] == pytest.approx(ring_added)
        assert extra_ctx.ring_bytes == plain.ring_bytes and extra_ctx.a2a_bytes == plain.a2a_bytes


def test_gqa_sends_only_the_kv_heads():
    job = Job(global_batch=8, seq_len=32768, precision="bf16")
    plan = Plan(dp=1, tp=8, cp=8, num_micro_batches=8)
    mha = dataclasses.replace(MODEL, num_kv_heads=32)
    volume = {m.num_kv_heads: context_comm(plan, NODES, model=m, job=job, core_forward_s=1.0, core_backward_s=2.5,
                                           collective_time_s=collective_time_s).ring_bytes for m in (MODEL, mha)}
    assert volume[32] == pytest.approx(4 * volume[8])


def test_attention_work_and_tokens_split_by_cp():
    # Megatron's flash kernels: the layer at cp 2 over 2S tokens is the layer over S tokens, with the
    # attention core of 2S tokens halved in place of the core of S tokens.
    eng, S = ENGINES["megatron"], 16384
    kw = dict(micro_batch=1, tp=8, sequence_parallel=True, precision="bf16", engine=eng)
    split = layer_compute_times(MODEL, H100, seq_len=2 * S, cp=2, ring_size=2, **kw)
    plain = layer_compute_times(MODEL, H100, seq_len=S, **kw)
    # Each ring step's kernels see half-chunks of 2S / (2 x 2) = S / 2 keys, which set their efficiency.
    ring_core = flash_attention_times_s(H100, kernel="flash3", micro_batch=1, seq_len=2 * S, num_heads=4,
                                        head_dim=128, key_block=S // 2)
    core = flash_attention_times_s(H100, kernel="flash3", micro_batch=1, seq_len=S, num_heads=4, head_dim=128)
    assert split.forward_s - plain.forward_s == pytest.approx(ring_core[0] / 2 - core[0], rel=1e-9)
    assert split.backward_s - plain.backward_s == pytest.approx(ring_core[1] / 2 - core[1], rel=1e-9)
    # The balanced split gives each rank half the causal pairs of the whole sequence: twice a plain S core,
    # a little slower for the shorter kernels.
    assert 2 * core[0] < ring_core[0] / 2 < 2.05 * core[0]


def test_our_ring_blocks_compute_r_plus_one_half_squares_in_fp32():
    hw = HW["cpu"]
    fwd, _ = ring_blocks_times_s(MODEL, hw, micro_batch=1, seq_len=8192, tp=1, cp=4, ring_size=4, dtype="fp32")
    one, _ = ring_blocks_times_s(MODEL, hw, micro_batch=1, seq_len=8192 // 4 * 1, tp=1, cp=1, ring_size=1,
                                 dtype="fp32")
    # (4 + 1) / 2 squares of 2048 tokens against one square (ring_size 1) of 2048 tokens, by hand: the two
    # GEMMs and the fp32 passes per score scale with the squares; step 0's causal mask covers one square.
    heads, s_r, d = MODEL.num_heads, 2048, MODEL.head_dim
    gemms = gemm_time_s(hw, Gemm(s_r, s_r, d, heads), dtype="fp32") + gemm_time_s(hw, Gemm(s_r, d, s_r, heads), dtype="fp32")
    square = heads * s_r * s_r
    assert fwd == pytest.approx(2.5 * gemms + memory_time_s(hw, 2.5 * square * 48 + square * 11, num_kernels=17 * 4), rel=1e-9)
    assert one == pytest.approx(gemms + memory_time_s(hw, square * (48 + 11), num_kernels=17), rel=1e-9)


def test_activations_fall_as_one_over_cp():
    job = Job(global_batch=8, seq_len=65536, precision="bf16")
    short = Job(global_batch=8, seq_len=65536 // 4, precision="bf16")
    cluster = Cluster(num_nodes=4, devices_per_node=8, hardware=H100)
    with_cp = layer_costs(Plan(dp=2, tp=4, cp=4, num_micro_batches=4), model=MODEL, cluster=cluster, job=job,
                          engine="megatron")
    without = layer_costs(Plan(dp=8, tp=4, num_micro_batches=1), model=MODEL, cluster=cluster, job=short,
                          engine="megatron")
    for policy in ("none", "selective", "full"):
        assert with_cp.activation_bytes[policy] == pytest.approx(without.activation_bytes[policy])


def test_cp_ranks_reduce_gradients_with_dp_and_engines_without_cp_refuse_it():
    job = Job(global_batch=8, seq_len=65536, precision="bf16")
    cluster = Cluster(num_nodes=4, devices_per_node=8, hardware=H100)
    plan = Plan(dp=2, tp=4, cp=4, num_micro_batches=4)
    est = estimate(plan, model=MODEL, cluster=cluster, job=job, engine="megatron")
    assert est.breakdown["cp_comm_s"] > 0 and est.breakdown["dp_comm_s"] > 0
    no_cp = estimate(plan.replace(dp=8, cp=1, num_micro_batches=1), model=MODEL, cluster=cluster,
                     job=Job(global_batch=8, seq_len=65536, precision="bf16"), engine="megatron")
    # The same 8 replicas reduce the same gradients either way.
    assert est.breakdown["dp_comm_s"] == pytest.approx(no_cp.breakdown["dp_comm_s"], rel=0.05)
    with pytest.raises(PlannerError, match="no context parallelism"):
        estimate(plan, model=MODEL, cluster=cluster, job=job, engine="deepspeed")


def test_this_engines_activations_per_rank_fall_exactly_as_one_over_cp():
    """This engine's CP layout (benchmarks/context_parallel.py's plans, 4 CPU ranks, one sequence per
    micro-batch): each rank keeps one micro-batch of seq / cp tokens, so the predicted activation peak per
    rank is cp1's over cp exactly, under every recomputation policy. No GQA: the ring and the unsplit fused
    core then keep the same tensors per token (the engine's measured saved bytes: 2.000x and 4.001x)."""
    model = dataclasses.replace(PRESETS["tiny"], hidden_size=128, num_heads=4, num_kv_heads=4, ffn_hidden_size=352,
                                num_layers=4, max_seq_len=4096)
    cluster = Cluster(num_nodes=1, devices_per_node=4, hardware=HW["cpu"])
    job = Job(global_batch=4, seq_len=2048, precision="fp32")
    for policy in ("none", "selective", "full"):
        plans = {1: Plan(dp=4, recompute=policy), 2: Plan(dp=2, cp=2, num_micro_batches=2, recompute=policy),
                 4: Plan(cp=4, num_micro_batches=4, recompute=policy)}
        act = {cp: estimate(p, model=model, cluster=cluster, job=job).breakdown["activations_bytes"]
               for cp, p in plans.items()}
        assert act[1] > 0
        for cp in (2, 4):
            assert act[1] / act[cp] == pytest.approx(cp, rel=1e-12)


def test_our_ring_keeps_a_score_square_only_where_it_writes_its_blocks_out():
    """On GPUs this engine's ring builds step 0's fp32 scores and probabilities (8 bytes a score of
    num_heads x (seq / cp)^2); on CPUs its steps run torch's flash kernel and keep no square."""
    job = Job(global_batch=1, seq_len=8192, precision="bf16")
    plan = Plan(cp=4, tp=2, num_micro_batches=1)
    square = 8.0 * MODEL.num_heads // 2 * (8192 // 4) ** 2
    gpu = layer_costs(plan, model=MODEL, cluster=Cluster(num_nodes=1, devices_per_node=8, hardware=H100), job=job)
    assert gpu.cp_working_bytes == pytest.approx(square)
    cpu = layer_costs(plan, model=MODEL, cluster=Cluster(num_nodes=1, devices_per_node=8, hardware=HW["cpu"]), job=job)
    assert cpu.cp_working_bytes == 0.0
    fused = layer_costs(plan, model=MODEL, cluster=Cluster(num_nodes=1, devices_per_node=8, hardware=H100), job=job,
                        engine="megatron")
    assert fused.cp_working_bytes == 0.0


def test_ring_exps_run_at_the_profiles_silu_rate():
    """The ring's exps are priced at the measured SiLU rate (8 bytes an element) where a profile has one,
    times the cores its processes share (not the fitted compute scale); without one, as a bandwidth-bound
    pass."""
    from cost_models.compute import ring_exp_time_s

    base = HW["cpu"]
    assert ring_exp_time_s(base, 1e6) == pytest.approx(memory_time_s(base, 8e6))
    measured = dataclasses.replace(base, elementwise_bytes_per_s={"silu": 4e9, "add": 40e9},
                                   calibration={"compute_time_scale": 3.0}, measured_processes=4, measured_cores=2)
    assert ring_exp_time_s(measured, 1e6) == pytest.approx(2.0 * 8e6 / 4e9)
    # Three exps a score (two forward, one backward) move from the bandwidth term to the exp term.
    fwd, bwd = ring_blocks_times_s(MODEL, measured, micro_batch=1, seq_len=4096, tp=1, cp=2, ring_size=2, dtype="fp32")
    plain_fwd, plain_bwd = ring_blocks_times_s(MODEL, dataclasses.replace(measured, elementwise_bytes_per_s={}),
                                               micro_batch=1, seq_len=4096, tp=1, cp=2, ring_size=2, dtype="fp32")
    scores = 1.5 * MODEL.num_heads * 2048 * 2048
    exp_s, as_bytes_s = 2.0 * 8 / 4e9, memory_time_s(measured, 8e9) / 1e9  # per element
    assert fwd - plain_fwd == pytest.approx(2 * scores * (exp_s - as_bytes_s), rel=1e-6)
    assert bwd - plain_bwd == pytest.approx(scores * (exp_s - as_bytes_s), rel=1e-6)



def test_blocking_collectives_wait_for_their_last_ranks_and_the_ring_does_not():
    """The sync-wait probe's keys (cost_models/comm.sync_wait_s) add to each layer pass's blocking
    collectives: the all-to-all's two meetings a pass (q, k, v before the core, the output after), TP's two,
    EP's dispatch and combine; full recomputation repeats the forward's. The ring waits for its neighbour
    behind the step's attention and adds nothing, nor does a profile without the keys (GPU profiles)."""
    from cost_models import moe as moe_cost

    cpu = dataclasses.replace(HW["cpu"], calibration={"op_overhead_s": 1e-5})
    wait = 4e-3  # after any segment longer than 2 microseconds
    keys = {"sync_wait_s_4_1": 0.0, "sync_wait_s_4_2": wait}
    cluster = Cluster(num_nodes=1, devices_per_node=4, hardware=cpu)
    slow = dataclasses.replace(cluster, hardware=dataclasses.replace(cpu, calibration={**cpu.calibration, **keys}))
    job = Job(global_batch=4, seq_len=128, precision="fp32")
    dense = dataclasses.replace(PRESETS["tiny"], num_heads=4, num_kv_heads=4)
    moe = PRESETS["tiny-moe"]
    cases = ((dense, Plan(cp=4, cp_kind="all-to-all", num_micro_batches=4), 4 * wait),
             (dense, Plan(tp=4, dp=1), 4 * wait),
             (moe, Plan(ep=4, dp=4), moe_cost.moe_fraction(moe) * 4 * wait),
             (dense, Plan(cp=4, num_micro_batches=4), 0.0), (dense, Plan(dp=4), 0.0))
    for model, plan, added in cases:
        plain = layer_costs(plan, model=model, cluster=cluster, job=job)
        waited = layer_costs(plan, model=model, cluster=slow, job=job)
        assert waited.time_s["none"] - plain.time_s["none"] == pytest.approx(added, rel=1e-9, abs=1e-15)
        assert waited.time_s["full"] - plain.time_s["full"] == pytest.approx(1.5 * added, rel=1e-9, abs=1e-15)
