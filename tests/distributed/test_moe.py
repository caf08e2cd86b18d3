"""Expert parallelism trains to the one-process losses (fp32, 1e-4) and parameters (harness.PARAM_TOL): the
tiny MoE model (8 experts top-2, a shared expert, a leading dense layer, the load-balancing loss) with its
experts split over EP ranks and each expert's width over expert-TP ranks, alone and with DP sharding of the
experts over expert-DP, TP + SP, context parallelism, pipelines, recomputation and a capacity factor that
drops tokens.

Plans of one world size share one set of gloo processes, as in test_exactness.py; 4 steps each.
"""

import pytest

from specs.plan import Plan
from tests.distributed.harness import cached_matrix_results, check_against_reference, tiny_config

MATRIX = {
    2: {
        "ep2": Plan(dp=2, ep=2, micro_batch=2, num_micro_batches=1),
        "ep2-accum-full-recompute": Plan(dp=2, ep=2, micro_batch=1, num_micro_batches=2, recompute="full"),
        "ep2-capacity": Plan(dp=2, ep=2, micro_batch=2, num_micro_batches=1),
        "dp2-experts-replicated-zero2": Plan(dp=2, grad_shard=2, optim_shard=2, micro_batch=2, num_micro_batches=1),
        # Qwen2-MoE: the sigmoid gate on the shared expert, q/k/v biases.
        "qwen2-moe-ep2": Plan(dp=2, ep=2, micro_batch=2, num_micro_batches=1),
        # Context parallelism: each CP rank routes its two chunks of a sequence, whose expert counts (the
        # load-balancing loss's) are summed over CP; EP folded over the CP ranks, or experts replicated there.
        "cp2-ring-ep2": Plan(cp=2, ep=2, micro_batch=2, num_micro_batches=1),
        "cp2-a2a-experts-replicated-accum": Plan(cp=2, cp_kind="all-to-all", micro_batch=1, num_micro_batches=2),
        # Expert TP: both ranks hold every expert, half its FFN width each; the rows are gathered over
        # ETP and the partial outputs reduce-scattered back.
        "etp2-accum": Plan(dp=2, etp=2, micro_batch=1, num_micro_batches=2),
        "cp2-ring-etp2": Plan(cp=2, etp=2, micro_batch=2, num_micro_batches=1),
    },
    4: {
        "ep4": Plan(dp=4, ep=4, micro_batch=1, num_micro_batches=1),
        # Experts over expert-DP 2 at (2, 2, 2); the dense parameters at ZeRO-3 over dp 4.
        "ep2-dp2-zero3": Plan(dp=4, ep=2, param_shard=4, grad_shard=4, optim_shard=4, micro_batch=1,
                              num_micro_batches=1),
        "ep2-dp2-lins-2-2-4": Plan(dp=4, ep=2, param_shard=2, grad_shard=2, optim_shard=4, micro_batch=1,
                                   num_micro_batches=2),
        # EP folds over the TP ranks (etp 1): each TP rank routes its SP slice; experts over expert-DP 2.
        "ep2-tp2-sp": Plan(dp=2, tp=2, ep=2, sequence_parallel=True, micro_batch=1, num_micro_batches=1),
        # Qwen3-MoE's attention (head_dim 16 on hidden 64, query/key head norms) under TP + SP.
        "qwen3-moe-ep2-tp2-sp": Plan(dp=2, tp=2, ep=2, sequence_parallel=True, micro_batch=1, num_micro_batches=1),
        # Counts summed over TP (SP) and then CP; EP 4 over tp x cp, the dense parameters at ZeRO-3 over cp.
        "cp2-tp2-sp-ep4-zero3": Plan(cp=2, tp=2, ep=4, sequence_parallel=True, param_shard=2, grad_shard=2,
                                     optim_shard=2, micro_batch=1, num_micro_batches=1),
        "cp2-dp2-ep2-full-recompute": Plan(cp=2, dp=2, ep=2, micro_batch=1, num_micro_batches=2, recompute="full"),
        "ep2-pp2-1f1b": Plan(dp=2, pp=2, ep=2, micro_batch=1, num_micro_batches=2),
        # ETP innermost (ranks 2q, 2q + 1), EP over the pairs; experts over expert-DP 1 or 2.
        "ep2-etp2": Plan(dp=4, ep=2, etp=2, micro_batch=1, num_micro_batches=1),
        "etp2-tp2-sp-zero3": Plan(dp=2, tp=2, etp=2, sequence_parallel=True, param_shard=2, grad_shard=2,
                                  optim_shard=2, micro_batch=1, num_micro_batches=1),
        "etp2-pp2-full-recompute": Plan(dp=2, pp=2, etp=2, micro_batch=1, num_micro_batches=2, recompute="full"),
        # The search's picks for tiny-moe on 4 CPU processes: MAZ3 tiers on the dense units (the experts'
        # own engine keeps none).
        "ep2-zero3-maz3-device": Plan(dp=4, ep=2, param_shard=4, grad_shard=4, optim_shard=4, param_cache="device",
                                      micro_batch=2, num_micro_batches=1),
        "ep2-zero3-maz3-host": Plan(dp=4, ep=2, param_shard=4, grad_shard=4, optim_shard=4, param_cache="host",
                                    micro_batch=1, num_micro_batches=2),
    },
    8: {
        # EP 4 over TP 2 x DP 4 (expert-DP 2), dense ZeRO-1 over dp 4 and experts' ZeRO-1 over expert-DP 2.
        "ep4-tp2-sp-zero1": Plan(dp=4, tp=2, ep=4, sequence_parallel=True, optim_shard=4, micro_batch=1,
                                 num_micro_batches=1),
        # ETP 2 x EP 2 over TP 2 x DP 4 (expert-DP 2, experts' ZeRO-1 over it).
        "ep2-etp2-tp2-sp-zero1": Plan(dp=4, tp=2, ep=2, etp=2, sequence_parallel=True, optim_shard=4, micro_batch=1,
                                      num_micro_batches=1),
        "ep2-tp2-pp2-sp-selective": Plan(dp=2, tp=2, pp=2, ep=2, sequence_parallel=True, micro_batch=1,
                                         num_micro_batches=2, recompute="selective"),
    },
}
# A capacity of ceil(0.5 x 32 x 2 / 8) = 4 assignments per expert and sequence: tokens are dropped.
MODEL_CHANGES = {"ep2-capacity": {"capacity_factor": 0.5},
                 "qwen2-moe-ep2": {"shared_expert_gate": True, "qkv_bias": True},
                 "qwen3-moe-ep2-tp2-sp": {"attention_head_dim": 16, "qk_norm": True}}
CASES = [(world, name) for world, plans in MATRIX.items() for name in plans]


def _config(world: int, name: str):
    return tiny_config(MATRIX[world][name], steps=4, model="tiny-moe", **MODEL_CHANGES.get(name, {}))


_result = cached_matrix_results(MATRIX, _config)


@pytest.mark.parametrize("world,name", CASES, ids=[f"{w}procs-{n}" for w, n in CASES])
def test_moe_matches_one_process(world, name):
    metrics, params = _result(world, name)
    check_against_reference(_config(world, name), metrics, params)
    assert any(k.endswith("experts.w_in") for k in params), "no expert parameters"
    if MATRIX[world][name].ep > 1:
        assert metrics.summary.comm_bytes["all_to_all"] > 0, "no token dispatch by all-to-all"
    if MATRIX[world][name].etp > 1:
        assert metrics.summary.comm_bytes["reduce_scatter"] > 0, "no expert-TP reduce-scatter"
