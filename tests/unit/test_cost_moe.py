"""cost_models/moe.py against hand-computed values (Mixtral-8x7B and the tiny MoE model)."""

import dataclasses
import math

import pytest

from cost_models.compute import Gemm, gemm_time_s
from cost_models.moe import (all_to_all_bytes, all_to_alls_per_layer, expected_imbalance, expert_params_per_device,
                             expert_state_bytes, moe_activation_bytes, moe_compute_times, moe_gemms, rows_per_expert)
from specs.hardware import PRESETS as HARDWARE_PRESETS
from specs.model import PRESETS
from specs.plan import Plan

MIXTRAL = PRESETS["mixtral-8x7b"]
TINY = PRESETS["tiny-moe"]


def test_rows_per_expert():
    # 4096 tokens per rank, ep 8: the group's 8 x 4096 x 2 assignments over 8 experts, one per rank.
    assert rows_per_expert(MIXTRAL, tokens=4096, ep=8) == 8192
    assert rows_per_expert(MIXTRAL, tokens=4096, ep=8, etp=2, imbalance=1.25) == 2 * 8192 * 1.25
    assert rows_per_expert(MIXTRAL, tokens=4096, ep=1) == 1024


def test_expected_imbalance_by_hand():
    qwen = PRESETS["qwen3-235b-a22b"]  # 128 experts, top-8, a balancing loss
    # ep 8, 4096 tokens a rank: 16 experts a rank. Sampling: 8 x (1/8)(7/8)(120/127) = 0.82677 per token,
    # sqrt(8 x 4096 x 0.82677) / (4096 x 8) = 0.0050231. Standing preference: 0.52 / sqrt(2 ln 128) /
    # sqrt(16) = 0.041733. Within sequences: 4096-token sequences, 8 of them in the group:
    # sqrt((7/8) / ((1/8) x 69.7 x 8)) = 0.112044. Busiest of 8: 1 + sqrt(2 ln 8) x 0.119668.
    assert expected_imbalance(qwen, tokens=4096, ep=8, seq_len=4096) == pytest.approx(1.244045, abs=2e-6)
    # 16384-token sequences split 4 ways by SP: the 8 ranks hold 2 sequences, sqrt(7 / (69.7 x 2)) = 0.224088.
    assert expected_imbalance(qwen, tokens=4096, ep=8, seq_len=16384) == pytest.approx(1.464960, abs=2e-6)
    # ... and one shared sequence at most: its CP and SP pieces on the group's ranks route alike.
    assert (expected_imbalance(qwen, tokens=1024, ep=8, seq_len=65536)
            > expected_imbalance(qwen, tokens=4096, ep=8, seq_len=32768) > 1.6)
    # Mixtral-8x7B at ep 8 holds one expert a rank: the busiest rank is the busiest expert, so the standing
    # term alone is the measured MaxVio, 0.52 (plus sampling: sqrt(8 x 4096 x 0.1875) / 8192, and within).
    sampling = math.sqrt(8 * 4096 * 2 * (1 / 8) * (7 / 8) * (6 / 7)) / 8192
    within = math.sqrt(7 / (69.7 * 8))
    expected = 1 + math.sqrt(2 * math.log(8)) * math.sqrt(sampling ** 2 + (0.52 / math.sqrt(2 * math.log(8))) ** 2
                                                           + within ** 2)
    assert expected_imbalance(MIXTRAL, tokens=4096, ep=8, seq_len=4096) == pytest.approx(expected)


def test_expected_imbalance_limits():
    qwen = PRESETS["qwen3-235b-a22b"]
    assert expected_imbalance(qwen, tokens=4096, ep=1, seq_len=4096) == 1.0  # no other rank to wait for
    # Forced balancing routes on random logits (Megatron-Core's RandomSTE): no preference, the sampling
    # floor stays, 1 + sqrt(2 ln 8) x 0.0050231; at 1024 tokens a rank (tp4 under SP) twice that spread.
    forced = dataclasses.replace(qwen, load_balancing="forced")
    assert expected_imbalance(forced, tokens=4096, ep=8, seq_len=4096) == pytest.approx(1.010244, abs=2e-6)
    assert expected_imbalance(forced, tokens=1024, ep=8, seq_len=4096) == pytest.approx(1.020488, abs=4e-6)
    # DeepSeek-V3's bias-adjusted routing: a standing MaxVio of 0.04 only, but each sequence still routes
    # its own way: 4 experts a rank at ep 64, 64 sequences, sqrt((63/64) / ((1/64) x 69.7 x 64)) = 0.118843.
    free = expected_imbalance(PRESETS["deepseek-v3"], tokens=4096, ep=64, seq_len=4096)
    assert free == pytest.approx(1.34, abs=0.01)
    # A capacity factor drops what exceeds it, so it caps the busiest rank.
    capped = dataclasses.replace(MIXTRAL, capacity_factor=1.25)
    assert expected_imbalance(capped, tokens=4096, ep=8, seq_len=4096) == 1.25
    # More ranks to wait for, fewer experts a rank to average: ep 32 (4 a rank) waits longer than ep 8 (16).
    assert expected_imbalance(qwen, tokens=4096, ep=32, seq_len=4096) > expected_imbalance(qwen, tokens=4096, ep=8,
                                                                                             seq_len=4096)


def test_expert_gemms_at_their_real_shapes():
    gemms = moe_gemms(MIXTRAL, tokens=4096, ep=4, etp=2)
    # 2 local experts, 2 x 4 x 4096 x 2 / 8 = 8192 rows each, FFN 14336 / 2.
    assert gemms["experts"] == [Gemm(8192, 7168, 4096, 2), Gemm(8192, 7168, 4096, 2), Gemm(8192, 4096, 7168, 2)]
    assert gemms["router"] == [Gemm(4096, 8, 4096)]
    assert gemms["shared"] == []
    # Expert FLOPs per rank are the rank's own assignments' whatever the split: 6 x T x k x h x F.
    flops = sum(g.flops for g in gemms["experts"])
    assert flops == 6 * 4096 * 2 * 4096 * 14336
    tiny = moe_gemms(TINY, tokens=64, ep=2, tp=2)
    assert tiny["shared"] == [Gemm(128, 16, 64), Gemm(128, 16, 64), Gemm(128, 64, 16)]


def test_compute_time_is_the_gemm_model_sum():
    hw = HARDWARE_PRESETS["h100"]
    times = moe_compute_times(MIXTRAL, hw, tokens=4096, ep=8, dtype="bf16")
    g = Gemm(8192, 14336, 4096, 1)
    down = Gemm(8192, 4096, 14336, 1)
    router = Gemm(4096, 8, 4096)
    expected = 2 * gemm_time_s(hw, g, dtype="bf16") + gemm_time_s(hw, down, dtype="bf16") + gemm_time_s(hw, router, dtype="fp32")
    assert times.forward_s == pytest.approx(expected)
    imbalanced = moe_compute_times(MIXTRAL, hw, tokens=4096, ep=8, imbalance=1.5, dtype="bf16")
    assert imbalanced.forward_s > times.forward_s


def test_all_to_all_bytes_by_top_k_and_node_boundary():
    # tokens x k x h x 2 bytes = 4096 x 2 x 4096 x 2 = 64 MiB of assignments; 1/8 per destination.
    per_dest = 4096 * 2 * 4096 * 2 / 8
    inside_node = all_to_all_bytes(MIXTRAL, tokens=4096, ep=8, ranks_per_node=8, precision="bf16")
    assert (inside_node.intra_node, inside_node.inter_node) == (7 * per_dest, 0.0)
    # etp 2: EP ranks sit 2 apart, so 4 of the 8 share a node and 4 destinations are remote.
    split = all_to_all_bytes(MIXTRAL, tokens=4096, ep=8, etp=2, ranks_per_node=8, precision="bf16")
    assert (split.intra_node, split.inter_node) == (3 * per_dest, 4 * per_dest)
    assert all_to_all_bytes(MIXTRAL, tokens=4096, ep=1, ranks_per_node=8, precision="bf16").total == 0
    assert (all_to_alls_per_layer("none"), all_to_alls_per_layer("full")) == (4, 6)


def test_expert_state_memory_under_ep_and_sharding():
    # 32 MoE layers x 8 experts / ep 8 x 3 x 4096 x 14336 / etp 1.
    params = 32 * 1 * 3 * 4096 * 14336
    assert expert_params_per_device(MIXTRAL, num_moe_layers=32, ep=8, etp=1) == params
    # bf16 ZeRO-1 over expert-DP 4: 2 + 2 + 12 / 4 bytes per parameter.
    state = expert_state_bytes(MIXTRAL, num_moe_layers=32, ep=8, etp=1, expert_shard_degrees=(1, 1, 4), precision="bf16")
    assert state == pytest.approx(params * (2 + 2 + 12 / 4))


def test_activation_bytes_hand_count():
    # tiny-moe, fp32, 64 tokens, ep 1: probs 4 x 64 x 8; rows = 64 x 2 = 128 assignments.
    expected = 4 * 64 * 8 + 4 * (128 * 64 + 3 * 128 * 32 + 64 * 2 * 64) + 4 * 64 * (64 + 3 * 32)
    assert moe_activation_bytes(TINY, tokens=64, precision="fp32") == expected


def _problem(model, *, devices, global_batch, seq_len, hardware="cpu", per_node=None, precision="fp32"):
    from specs.cluster import Cluster
    from specs.job import Job
    from specs.problem import Problem

    per_node = per_node or devices
    cluster = Cluster(num_nodes=devices // per_node, devices_per_node=per_node, hardware=HARDWARE_PRESETS[hardware])
    return Problem(model=model, cluster=cluster, job=Job(global_batch=global_batch, seq_len=seq_len, precision=precision))


def test_estimate_holds_experts_split_over_ep_and_sharded_over_expert_dp():
    from cost_models.estimate import estimate
    from specs.plan import Plan

    problem = _problem(MIXTRAL, devices=64, per_node=8, global_batch=64, seq_len=4096, hardware="h100", precision="bf16")
    kwargs = dict(model=MIXTRAL, cluster=problem.cluster, job=problem.job)
    base = dict(dp=16, pp=4, micro_batch=1, num_micro_batches=4, recompute="full")
    replicated = estimate(Plan(**base), **kwargs).breakdown
    split = estimate(Plan(ep=8, **base), **kwargs).breakdown
    # A stage holds 8 of the 32 layers: its experts are 8 x 8 x 3 h F weights, 2 bytes each, / ep.
    experts = 8 * 8 * MIXTRAL.expert_params()
    assert replicated["weights_bytes"] - split["weights_bytes"] == pytest.approx(2 * experts * (1 - 1 / 8), rel=1e-9)
    # ZeRO-1 over dp 16: the experts' optimizer states over expert-DP 16 / 8 = 2.
    zero1 = estimate(Plan(ep=8, optim_shard=16, **base), **kwargs).breakdown
    dense_params = split["weights_bytes"] / 2 - experts / 8
    assert zero1["optimizer_bytes"] == pytest.approx(12 * (dense_params / 16 + experts / 8 / 2), rel=1e-9)


def test_search_enumerates_ep_and_proposes_only_what_the_engine_runs():
    from planner.search import SearchOptions, search
    from runners.transformer import check_model_runnable
    from specs.plan import check_plan

    problem = _problem(TINY, devices=4, global_batch=8, seq_len=64)
    result = search(problem, options=SearchOptions(top_k=200))
    plans = [c.plan for c in result.candidates]
    assert {p.ep for p in plans} == {1, 2, 4}
    for plan in plans:
        check_plan(plan, model=TINY, num_devices=4, job=problem.job)
        check_model_runnable(TINY, plan)
        assert plan.tp == 1 or plan.sequence_parallel
    assert {p.etp for p in plans if p.tp == 2} == {1, 2}  # expert TP where the attention has TP


@pytest.mark.parametrize("plan,what", [
    (Plan(tp=2, dp=2), "tp > 1 without sequence_parallel"),
    (Plan(tp=2, dp=2, ep=2), "tp > 1 without sequence_parallel"),
])
def test_the_engine_refuses_moe_plans_it_would_run_wrong(plan, what):
    # TP without SP: both TP ranks would route the same tokens and each expert's gradient would be summed
    # twice over expert-DP (Adam hides the factor; the first-step gradient check in test_gradients.py does not).
    from runners.transformer import check_model_runnable

    with pytest.raises(ValueError, match=what):
        check_model_runnable(TINY, plan)
    check_model_runnable(TINY, plan.replace(sequence_parallel=True))


def test_a_sequences_expert_counts_are_summed_over_tp_and_cp_every_forward():
    # runners/moe.py `_sequence_counts`: micro-batch x experts int64, all-reduced over TP under SP, then over CP;
    # a fully recomputed layer runs its forward twice.
    from cost_models.estimate import _routing_counts_s, collective_time_s, layer_costs
    from specs.plan import Plan

    problem = _problem(TINY, devices=8, global_batch=8, seq_len=64)
    cluster, job = problem.cluster, problem.job
    plan = Plan(cp=2, tp=2, ep=2, dp=2, sequence_parallel=True, micro_batch=1, num_micro_batches=4)
    nbytes = TINY.num_experts * 8
    want = (collective_time_s(cluster, collective="all_reduce", size_bytes=nbytes, group_size=2, stride=1)
            + collective_time_s(cluster, collective="all_reduce", size_bytes=nbytes, group_size=2, stride=2))
    want += collective_time_s(cluster, collective="all_to_all", size_bytes=nbytes, group_size=2, stride=1)  # EP's
    assert _routing_counts_s(plan, cluster, model=TINY) == pytest.approx(want, rel=1e-12) and want > 0
    assert _routing_counts_s(Plan(dp=8, micro_batch=1, num_micro_batches=1), cluster, model=TINY) == 0
    costs = layer_costs(plan, model=TINY, cluster=cluster, job=job)
    assert costs.time_s["full"] > costs.time_s["none"]


def test_all_to_all_time_is_the_slower_link():
    from cost_models.comm import flat_collective_time_s
    from cost_models.moe import all_to_all_time_s

    hw = HARDWARE_PRESETS["h100"]
    per_dest = 4096 * 2 * 4096 * 2 / 16
    # ep 16 over two nodes of 8: 7 destinations over NVLink, 8 over the NIC; the NIC is the slower.
    inter = flat_collective_time_s(hw, collective="p2p", size_bytes=8 * per_dest, group_size=2, link="inter_node")
    expected = inter + 7 * hw.link("inter_node").latency_s
    assert all_to_all_time_s(MIXTRAL, hw, tokens=4096, ep=16, ranks_per_node=8, precision="bf16") == pytest.approx(expected)
    assert all_to_all_time_s(MIXTRAL, hw, tokens=4096, ep=1, ranks_per_node=8, precision="bf16") == 0.0


def test_published_moe_rows_are_priced_with_their_expert_layout():
    from planner.published import load_published

    from pathlib import Path

    runs, skipped = load_published(Path(__file__).resolve().parents[2] / "benchmarks" / "published" / "moe_runs.csv")
    # 26 rows: NeMo AutoModel's 6 are use=no (no engine model), the 96-stage Qwen3 split is skipped.
    assert len(runs) == 19
    assert {r.model.name for r in runs} >= {"qwen3-30b-a3b", "qwen3-235b-a22b", "GPT-OSS-120B"}
    assert all(r.model.is_moe and r.plan.ep > 1 for r in runs)
    assert skipped == [s for s in skipped if "96 exceeds the model's 94 layers" in s] and len(skipped) == 1


def test_share_of_nodes_or_ranks_a_token_reaches():
    from cost_models.moe import share_of_groups_hit

    # Mixtral's 2 of 8 experts miss a given expert with (7/8)(6/7) = 3/4.
    assert share_of_groups_hit(num_experts=8, top_k=2, group_experts=1) == pytest.approx(0.25)
    assert share_of_groups_hit(num_experts=8, top_k=2, group_experts=8) == 1.0


def test_deepep_sends_a_token_once_per_node_and_rank_not_per_expert():
    qwen = PRESETS["qwen3-30b-a3b"]  # 128 experts, top-8, hidden 2048
    row = 4096 * 2048 * 2  # one micro-batch's tokens in bf16
    # ep 16 over two 8-GPU nodes: 8 experts a rank, 64 a node. Alltoall sends the 8 copies of a token,
    # half of the 16 ranks in the other node: 8 x 8 / 16 rows a token over the NIC.
    a2a = all_to_all_bytes(qwen, tokens=4096, ep=16, ranks_per_node=8, precision="bf16")
    assert a2a.inter_node == pytest.approx(row * 8 * 8 / 16)
    deep = all_to_all_bytes(qwen, tokens=4096, ep=16, ranks_per_node=8, precision="bf16", dispatcher="deepep")
    miss_node = 64 / 128 * 63 / 127 * 62 / 126 * 61 / 125 * 60 / 124 * 59 / 123 * 58 / 122 * 57 / 121
    miss_rank = 120 / 128 * 119 / 127 * 118 / 126 * 117 / 125 * 116 / 124 * 115 / 123 * 114 / 122 * 113 / 121
    assert deep.inter_node == pytest.approx(row * (1 - miss_node))
    assert deep.intra_node == pytest.approx(row * (15 * (1 - miss_rank) - (1 - miss_node)))
    with pytest.raises(ValueError, match="dispatcher"):
        all_to_all_bytes(qwen, tokens=4096, ep=16, ranks_per_node=8, precision="bf16", dispatcher="nccl")


def test_ep_overlap_hides_each_all_to_all_only_behind_its_own_phase():
    """Megatron-Core's combined 1F1B runs a layer pair as four phases (combine backward | attention forward,
    dispatch forward | experts' input gradients, dispatch backward | experts' weight gradients + forward,
    combine forward | attention's input gradients): 1 s all-to-alls beside 0.5 + 0.5, 0.6, 0.6 + 0.6 and
    0.5 s of compute show 0, 0.4, 0 and 0.5 s, where the whole layer's 3.3 s against 4 s would show 0.7."""
    from cost_models.estimate import _phased_ep_comm
    from cost_models.moe import MoETimes
    from specs.cluster import Cluster

    gpu = Cluster(num_nodes=1, devices_per_node=8, hardware=HARDWARE_PRESETS["h100"])
    kw = dict(a2a_s=1.0, attn_forward_s=0.5, attn_backward_s=1.0, moe=MoETimes(forward_s=0.6, backward_s=1.2),
              cluster=gpu)
    exposed = _phased_ep_comm({"none": 4.0, "full": 6.0}, efficiency=1.0, **kw)
    # the recomputed forward pair of full recomputation stays exposed
    assert exposed == pytest.approx({"none": 0.9, "full": 2.9})
    # beside the SMs an all-to-all holds, compute at half speed covers half as much of each phase
    assert _phased_ep_comm({"none": 4.0}, efficiency=0.5, **kw)["none"] == pytest.approx(0.5 + 0.7 + 0.5 + 0.75)


def test_permutation_bytes_follow_the_dispatcher():
    """Qwen3-235B, 4096 tokens a rank at ep 8 (16 local experts, 32768 assignments each way), bf16 rows of
    4096 x 2 bytes. Megatron-Core's all-to-all dispatcher gathers the rank's 32768 assignments before the
    all-to-all (read + write), sorts the 32768 received rows by local expert after it and back before the
    combine (2 x read + write), and sums the returned rows into the 4096 tokens (read 32768, write 4096);
    the flex dispatcher (DeepEP, HybridEP) receives each token once per rank that holds one of its
    experts, spreads those to the 32768 expert rows and sums them back: 3 x 32768 + unique rows. With one
    expert a rank (Mixtral at ep 8) nothing is sorted after the all-to-all."""
    from cost_models.moe import permutation_bytes, share_of_groups_hit

    qwen, row = PRESETS["qwen3-235b-a22b"], 4096 * 2
    kw = dict(tokens=4096, ep=8, precision="bf16")
    assert permutation_bytes(qwen, **kw) == row * (3 * 32768 + 4096 + 4 * 32768)
    unique = 8 * 4096 * share_of_groups_hit(num_experts=128, top_k=8, group_experts=16)
    for dispatcher in ("deepep", "hybridep"):
        assert permutation_bytes(qwen, dispatcher=dispatcher, **kw) == pytest.approx(row * (3 * 32768 + unique))
    assert permutation_bytes(MIXTRAL, **kw) == 4096 * 2 * (3 * 4096 * 2 + 4096)
    with pytest.raises(ValueError, match="dispatcher"):
        permutation_bytes(qwen, dispatcher="nccl", **kw)


def test_megatron_prices_expert_weight_gradients_into_fp32_main_grads():
    """Qwen3-235B at tp4 ep8 (1024 tokens a rank, 512 rows for each of 16 local experts): each expert's
    weight gradients add into 4096 x 1536 fp32 main gradients, bound by those bytes, so the megatron
    engine's MoE layer backward is slower than the same GEMMs written once; the forward is unchanged."""
    from cost_models.engines import ENGINES
    from cost_models.moe import moe_compute_times

    qwen, hw = PRESETS["qwen3-235b-a22b"], HARDWARE_PRESETS["h100"]
    kw = dict(tokens=1024, ep=8, tp=4, dtype="bf16")
    fused = moe_compute_times(qwen, hw, accumulate_fp32=ENGINES["megatron"].main_grads_fp32, **kw)
    plain = moe_compute_times(qwen, hw, **kw)
    assert fused.forward_s == plain.forward_s
    # per expert: gate and up (4096 x 1536 each, K = 512 rows) and down (1536 x 4096)
    rows = 512
    accumulate_bytes = 16 * 3 * (4096 * 1536 * 8 + (4096 + 1536) * rows * 2)
    assert fused.backward_s - plain.backward_s > 0.5 * accumulate_bytes / (3.35e12 * 0.8)


def test_dispatcher_and_ep_overlap_change_the_cross_node_step():
    import dataclasses

    from cost_models.engines import ENGINES
    from cost_models.estimate import estimate
    from specs.cluster import Cluster
    from specs.job import Job
    from specs.plan import Plan

    model = PRESETS["qwen3-30b-a3b"]
    cluster = Cluster(num_nodes=2, devices_per_node=8, hardware=HARDWARE_PRESETS["h100"])
    plan = Plan(dp=16, ep=16, micro_batch=1, num_micro_batches=4, param_shard=1, grad_shard=16, optim_shard=16)
    job = Job(global_batch=64, seq_len=4096, precision="bf16")
    times = {name: estimate(plan, model=model, cluster=cluster, job=job, engine=dataclasses.replace(ENGINES["megatron"], **kw)).step_time_s
             for name, kw in (("a2a", {}), ("deepep", {"moe_dispatcher": "deepep"}), ("overlap", {"moe_a2a_overlap": True}))}
    assert times["deepep"] < times["a2a"] and times["overlap"] < times["a2a"]


def _named_recompute_costs(modules):
    from cost_models.engines import ENGINES
    from cost_models.estimate import layer_costs
    from specs.plan import Plan

    qwen = dataclasses.replace(PRESETS["qwen3-30b-a3b"], load_balancing="forced")  # every layer MoE
    problem = _problem(qwen, devices=8, global_batch=8, seq_len=4096, hardware="h100", precision="bf16")
    engine = dataclasses.replace(ENGINES["megatron"], recompute_modules=modules)
    plan = Plan(dp=8, ep=8, micro_batch=1, num_micro_batches=1, recompute="selective")
    return qwen, problem, layer_costs(plan, model=qwen, cluster=problem.cluster, job=problem.job, engine=engine)


def test_layernorm_recompute_reruns_the_two_norms_and_not_the_core():
    from cost_models.compute import memory_time_s

    _, problem, default = _named_recompute_costs(("core_attn",))
    _, _, norms = _named_recompute_costs(("layernorm",))
    # 4096 tokens x 2048 wide in bf16: each norm reads and writes them once, two kernels.
    norm_s = memory_time_s(problem.cluster.hardware, 2 * 2 * 2 * 4096 * 2048, num_kernels=2)
    assert norms.recompute_time_s["selective"] == pytest.approx(norm_s, rel=1e-9)
    assert norms.time_s["selective"] == pytest.approx(default.time_s["none"] + norm_s, rel=1e-9)
    # Neither norm output is kept: 2 x 4096 x 2048 x 2 bytes fewer than without recomputation.
    assert default.activation_bytes["none"] - norms.activation_bytes["selective"] == pytest.approx(2 * 2 * 4096 * 2048)


def test_moe_recompute_reruns_the_moe_layer_with_its_dispatch():
    from cost_models.moe import moe_activation_bytes, permutation_times_s

    qwen, problem, default = _named_recompute_costs(("core_attn",))
    _, _, moe = _named_recompute_costs(("moe",))
    hw = problem.cluster.hardware
    # The MoE layer's forward on one rank: 4096 tokens a rank, ep 8, forced (random) routing's busiest rank.
    imbalance = expected_imbalance(qwen, tokens=4096, ep=8, seq_len=4096)
    forward_s = (moe_compute_times(qwen, hw, tokens=4096, ep=8, dtype="bf16", imbalance=imbalance,
                                   expert_streams=4).forward_s  # Transformer Engine's 4 GEMM streams
                 + permutation_times_s(qwen, hw, tokens=4096, ep=8, precision="bf16", imbalance=imbalance).forward_s)
    assert moe.recompute_time_s["selective"] == pytest.approx(forward_s, rel=1e-9)
    # Its dispatch and combine run again: the selective policy's communication is full recomputation's.
    assert moe.tp_comm_s["selective"] == pytest.approx(default.tp_comm_s["full"], rel=1e-9)
    kept = moe_activation_bytes(qwen, tokens=4096, ep=8, precision="bf16", imbalance=imbalance)
    assert default.activation_bytes["none"] - moe.activation_bytes["selective"] == pytest.approx(kept, rel=1e-9)


def test_moe_act_recompute_reruns_the_swiglu():
    from cost_models.compute import memory_time_s

    qwen, problem, default = _named_recompute_costs(("core_attn",))
    _, _, act = _named_recompute_costs(("moe_act",))
    # 4096 x 8 rows of width 768 on the rank's 16 experts (times the busiest rank's share under random
    # routing): two read and one written, bf16.
    rows, width = 4096 * 8 * expected_imbalance(qwen, tokens=4096, ep=8, seq_len=4096), 768
    assert act.recompute_time_s["selective"] == pytest.approx(
        memory_time_s(problem.cluster.hardware, 3 * 2 * rows * width, num_kernels=1), rel=1e-9)
    assert default.activation_bytes["none"] - act.activation_bytes["selective"] == pytest.approx(2 * rows * width)


def test_ep_overlap_pairs_only_the_steady_passes():
    from cost_models.estimate import paired_share
    from specs.plan import Plan

    # Interleaved pp 8 x v 4, 128 micro-batches: rank r warms up 2 (7 - r) + 24 chunks, 38 .. 24, 248 in
    # all of the 8 x 512 passes.
    plan = Plan(dp=16, tp=2, pp=8, virtual_stages=4, micro_batch=1, num_micro_batches=128, schedule="interleaved-1f1b")
    assert paired_share(plan) == pytest.approx((8 * 512 - 248) / (8 * 512))
    # No pipeline: the first forward and the last backward of 4 micro-batches run alone.
    assert paired_share(Plan(dp=8, micro_batch=1, num_micro_batches=4)) == pytest.approx(3 / 4)
    # 1F1B over pp 4, 8 micro-batches: warm-ups 3, 2, 1 and (at least) 1.
    assert paired_share(Plan(dp=8, pp=4, micro_batch=1, num_micro_batches=8)) == pytest.approx((32 - 7) / 32)


def test_megatron_runs_expert_gemms_four_at_a_time():
    """Transformer Engine's GroupedLinear puts each local expert's GEMM on one of its 4 compute streams:
    16 experts run as 4 rounds of 4 (a 13-expert rank as 3 rounds and a round of 1), each round's waves
    quantized on its own, which is never faster than one batch of 16 over the SMs."""
    from cost_models.moe import concurrent_rounds

    g = Gemm(2048, 768, 2048, 16)
    assert concurrent_rounds(g, streams=4) == [Gemm(2048, 768, 2048, 4)] * 4
    assert concurrent_rounds(Gemm(8, 8, 8, 13), streams=4) == [Gemm(8, 8, 8, 4)] * 3 + [Gemm(8, 8, 8, 1)]
    assert concurrent_rounds(g, streams=1) == [Gemm(2048, 768, 2048, 1)] * 16
    qwen, hw = PRESETS["qwen3-30b-a3b"], HARDWARE_PRESETS["h100"]
    kw = dict(tokens=4096, ep=8, dtype="bf16")
    batched, streamed = moe_compute_times(qwen, hw, **kw), moe_compute_times(qwen, hw, expert_streams=4, **kw)
    assert streamed.forward_s > batched.forward_s and streamed.backward_s > batched.backward_s
    # The flops are the same; only the waves differ.
    assert sum(r.flops for r in concurrent_rounds(g, streams=4)) == g.flops


def test_moe_layer_pays_only_the_attentions_tp_collectives():
    """Under TP with SP a dense layer gathers and scatters its tokens twice (attention and MLP); Megatron-Core's
    MoE layer routes each TP rank's own shard (etp 1: no expert-TP collective), so the MoE layer's part
    outside its MLP keeps half the dense layer's TP communication, forward and backward."""
    from cost_models.estimate import _without_mlp_tp_comm, layer_costs
    from cost_models.moe import attention_view
    from specs.plan import Plan

    qwen = dataclasses.replace(PRESETS["qwen3-30b-a3b"], load_balancing="forced")
    problem = _problem(qwen, devices=8, global_batch=8, seq_len=4096, hardware="h100", precision="bf16")
    plan = Plan(dp=4, tp=2, ep=8, sequence_parallel=True, micro_batch=1, num_micro_batches=1)
    attn = layer_costs(plan, model=attention_view(qwen, tp=2), cluster=problem.cluster, job=problem.job,
                       engine="megatron")
    kept = _without_mlp_tp_comm(attn)
    for pol in ("none", "selective", "full"):
        assert attn.tp_comm_s[pol] > 0
        assert kept.tp_comm_s[pol] == pytest.approx(attn.tp_comm_s[pol] / 2)  # no CP here: all of it is TP
        assert attn.time_s[pol] - kept.time_s[pol] == pytest.approx(attn.tp_comm_s[pol] / 2)
        # the forward's TP seconds are half of the no-recompute total (forward + backward)
        assert attn.forward_time_s[pol] - kept.forward_time_s[pol] == pytest.approx(attn.tp_comm_s["none"] / 4)


def test_a_shared_expert_keeps_the_mlp_tp_collectives():
    """A shared expert is a TP-split dense MLP over the gathered sequence (Megatron-Core's SharedExpertMLP
    gathers before and reduce-scatters after it), so its layer keeps both pairs: halving the routed-only
    layer's TP communication must not touch a model with one."""
    from cost_models.estimate import layer_costs
    from cost_models.moe import attention_view
    from specs.plan import Plan

    plan = Plan(dp=4, tp=2, ep=8, sequence_parallel=True, micro_batch=1, num_micro_batches=1)
    shares = {}
    for name, fs in (("routed", 0), ("shared", 2048)):
        model = dataclasses.replace(PRESETS["qwen3-30b-a3b"], load_balancing="forced", shared_expert_ffn_hidden_size=fs)
        problem = _problem(model, devices=8, global_batch=8, seq_len=4096, hardware="h100", precision="bf16")
        kw = dict(cluster=problem.cluster, job=problem.job, engine="megatron")
        moe, attn = layer_costs(plan, model=model, **kw), layer_costs(plan, model=attention_view(model, tp=2), **kw)
        shares[name] = moe.tp_comm_s["none"] - attn.tp_comm_s["none"]  # the MoE MLP's part, less what is dropped
    dropped = shares["shared"] - shares["routed"]
    single = layer_costs(plan, model=attention_view(dataclasses.replace(PRESETS["qwen3-30b-a3b"],
                                                                        load_balancing="forced"), tp=2), **kw)
    assert dropped == pytest.approx(single.tp_comm_s["none"] / 2, rel=1e-6)


def test_fp8_expert_casts_by_hand():
    """Transformer Engine's current scaling casts each expert's operands on its own: amax (2 bytes read), scale
    (a tiny kernel: the 5 us floor) and cast + transpose (2 read, 1 + 1 written), each kernel floored at 5 us.
    Qwen3-30B-A3B at ep 16, 4096 tokens: 8 local experts of 16 x 4096 x 8 / 128 = 4096 rows; H100 at 0.8 x
    3.35 TB/s = 2.68 TB/s. Width 2048: 16.78 MB / 2.68e12 = 6.260 us + 5 us + 33.55 MB -> 12.520 us = 23.780 us;
    width 768: 6.29 and 12.58 MB both under the floor, 15 us; width 1536: 5 + 5 + 25.17 MB -> 9.390 us = 19.390 us.
    Forward (fc1 input 2048, fc2 input 768): 8 x 38.780 = 310.24 us; backward (fc2 output gradient 2048, fc1's
    gated 1536): 8 x 43.171 = 345.37 us."""
    from cost_models.moe import fp8_quantize_times_s

    times = fp8_quantize_times_s(PRESETS["qwen3-30b-a3b"], HARDWARE_PRESETS["h100"], tokens=4096, ep=16)
    assert times.forward_s == pytest.approx(310.2437e-6, rel=1e-6)
    assert times.backward_s == pytest.approx(345.3656e-6, rel=1e-6)


def test_fp8_experts_run_fp8_gemms_and_their_casts():
    """Under fp8 the MoE MLP is the experts' fp8 GEMMs, the permutations and the casts, not bf16 GEMMs."""
    from cost_models.engines import ENGINES
    from cost_models.estimate import _moe_mlp_times
    from cost_models.moe import fp8_quantize_times_s, permutation_times_s
    from specs.plan import Plan

    model, hw, eng = PRESETS["qwen3-30b-a3b"], HARDWARE_PRESETS["h100"], ENGINES["megatron"]
    plan = Plan(dp=16, ep=16, micro_batch=1, num_micro_batches=1)
    kw = dict(tokens=4096, ep=16, imbalance=1.0)
    got = _moe_mlp_times(model, hw, plan=plan, precision="fp8", eng=eng, tokens=4096, imbalance=1.0)
    gemms = moe_compute_times(model, hw, dtype="fp8", accumulate_fp32=True, expert_streams=4, **kw)
    perm = permutation_times_s(model, hw, precision="fp8", dispatcher="alltoall", **kw)
    casts = fp8_quantize_times_s(model, hw, **kw)
    assert got.forward_s == pytest.approx(gemms.forward_s + perm.forward_s + casts.forward_s)
    assert got.backward_s == pytest.approx(gemms.backward_s + perm.backward_s + casts.backward_s)
    bf16 = moe_compute_times(model, hw, dtype="bf16", accumulate_fp32=True, expert_streams=4, **kw)
    assert gemms.forward_s < 0.7 * bf16.forward_s  # the fp8 tensor cores' rate, not bf16's


def test_cpu_dispatch_is_priced_as_glooss_all_to_all_and_the_counts_exchange_every_forward():
    # On CPU the dispatch is gloo's alltoall, which the profile times (its all_to_all curve, plus the per-call
    # overhead); every forward under EP first exchanges the per-expert counts (plan_dispatch).
    from cost_models.estimate import _ep_all_to_all_s, _routing_counts_s, collective_time_s
    from cost_models.engines import engine_model
    from specs.plan import Plan

    problem = _problem(TINY, devices=4, global_batch=8, seq_len=64)
    plan = Plan(dp=4, ep=2, micro_batch=1, num_micro_batches=2)
    buffer = 64 * TINY.num_experts_per_token * TINY.hidden_size * 4
    got = _ep_all_to_all_s(plan, problem.cluster, model=TINY, eng=engine_model("ours"), tokens=64, precision="fp32",
                           buffer_bytes=buffer)
    assert got == collective_time_s(problem.cluster, collective="all_to_all", size_bytes=buffer, group_size=2,
                                    stride=1) > 0
    counts = collective_time_s(problem.cluster, collective="all_to_all", size_bytes=TINY.num_experts * 8, group_size=2,
                               stride=1)
    assert _routing_counts_s(plan, problem.cluster, model=TINY) == pytest.approx(counts, rel=1e-12)
    assert _ep_all_to_all_s(Plan(dp=4, micro_batch=1, num_micro_batches=2), problem.cluster, model=TINY,
                            eng=engine_model("ours"), tokens=64, precision="fp32", buffer_bytes=buffer) == 0


def test_every_cpu_all_to_all_pays_the_context_probes_extra_per_call():
    # engine_a2a_extra_s_{c} (the context probe's in-engine cost of a blocking all-to-all beyond the curve,
    # planner/profiling.py) joins every all-to-all the engine blocks on: EP's dispatch and the counts
    # exchange as CP's, at the nearest measured group size.
    import dataclasses

    from cost_models.engines import engine_model
    from cost_models.estimate import _ep_all_to_all_s, _routing_counts_s
    from specs.plan import Plan

    problem = _problem(TINY, devices=4, global_batch=8, seq_len=64)
    hardware = problem.cluster.hardware
    extra = dataclasses.replace(problem.cluster, hardware=dataclasses.replace(
        hardware, calibration={**hardware.calibration, "engine_a2a_extra_s_4": 5e-4}))
    plan = Plan(dp=4, ep=2, micro_batch=1, num_micro_batches=2)
    buffer = 64 * TINY.num_experts_per_token * TINY.hidden_size * 4
    kw = dict(model=TINY, eng=engine_model("ours"), tokens=64, precision="fp32", buffer_bytes=buffer)
    assert _ep_all_to_all_s(plan, extra, **kw) == pytest.approx(_ep_all_to_all_s(plan, problem.cluster, **kw) + 5e-4)
    assert _routing_counts_s(plan, extra, model=TINY) == pytest.approx(
        _routing_counts_s(plan, problem.cluster, model=TINY) + 5e-4)


def test_moe_op_counts_are_the_engines():
    """moe_extra_ops against the aten ops runners/moe.py's MoE MLP dispatches beyond a dense MLP's (one process;
    at ep 2 rank 0 with the all-to-alls replaced by uncounted fills: they are priced as collectives). Views are
    not ops."""
    import torch

    from cost_models.moe import moe_extra_ops
    from runners.expert_parallel import EPContext
    from runners.moe import MoE
    from runners.tensor_parallel import TPContext
    from runners.transformer import MLP
    from tests.opcount import forward_backward_ops, uncounted

    class FillComm:
        def all_to_all(self, out, x, group):
            with uncounted():
                out.copy_(x)

        def all_to_all_uneven(self, out, x, *, output_splits, input_splits, group, kind="all_to_all"):
            with uncounted():
                out.zero_()

        def all_gather(self, out, x, group):  # the ETP group's received counts: every rank's are mine
            with uncounted():
                out.copy_(x.repeat(out.shape[0] // x.shape[0], 1))

    def ops(module, spec):
        return forward_backward_ops(module, torch.randn(32, 2, spec.hidden_size, requires_grad=True))

    for changes, ep, etp in (({}, 1, 1), ({}, 2, 1), ({"shared_expert_ffn_hidden_size": 0, "aux_loss_coeff": 0.0}, 1, 1),
                             ({"num_experts": 4}, 1, 1), ({"shared_expert_gate": True}, 2, 1), ({}, 1, 2), ({}, 2, 2)):
        spec = dataclasses.replace(TINY, **changes)
        tp = TPContext.single()
        shared = (MLP(spec, name="layers.1.mlp.shared", seed=0, tp=tp, ffn=spec.shared_expert_ffn_hidden_size)
                  if spec.shared_expert_ffn_hidden_size else None)
        group = (EPContext.single() if ep == etp == 1 else
                 EPContext(group=None, rank=0, size=ep, comm=FillComm(), etp_group=None, etp_rank=0, etp_size=etp))
        moe = MoE(spec, name="layers.1.mlp", seed=0, tp=tp, ep=group, aux_scale=0.1, shared=shared)
        moe_f, moe_b = ops(moe, spec)
        dense_f, dense_b = ops(MLP(spec, name="layers.1.mlp", seed=0, tp=tp), spec)
        assert moe_extra_ops(spec, ep=ep, etp=etp) == (moe_f - dense_f, moe_b - dense_b), (changes, ep, etp)
