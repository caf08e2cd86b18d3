"""Context parallelism trains to the one-process losses (fp32, 1e-4) and parameters (1e-3): ring, all-to-all
and hierarchical attention, alone and with DP sharding over dp x cp, TP + SP and pipelines.

Plans of one world size share one set of gloo processes, as in test_exactness.py; 4 steps each (the ring's
forward and backward run every step, so more steps would only repeat them).
"""

import pytest

from specs.plan import Plan
from tests.distributed.harness import cached_matrix_results, check_against_reference, tiny_config

MATRIX = {
    2: {
        "cp2-ring": Plan(cp=2, micro_batch=2, num_micro_batches=1),
        "cp2-a2a-accum": Plan(cp=2, cp_kind="all-to-all", micro_batch=1, num_micro_batches=2),
        # Learned positions follow the chunk layout too; full recomputation runs the ring again.
        "gpt2-cp2-ring-full-recompute": Plan(cp=2, micro_batch=2, num_micro_batches=1, recompute="full"),
        # Qwen's attention (head_dim 16 on hidden 64, q/k/v biases, query/key head norms) split over heads.
        "qwen-cp2-a2a": Plan(cp=2, cp_kind="all-to-all", micro_batch=2, num_micro_batches=1),
    },
    4: {
        "cp4-ring": Plan(cp=4, micro_batch=2, num_micro_batches=1),
        "cp4-a2a": Plan(cp=4, cp_kind="all-to-all", micro_batch=2, num_micro_batches=1),
        # Two ranks per emulated node: all-to-all inside each pair, a ring of two across.
        "cp4-hierarchical": Plan(cp=4, cp_kind="hierarchical", micro_batch=1, num_micro_batches=2),
        "cp2-dp2-zero3-full-recompute": Plan(cp=2, dp=2, param_shard=4, grad_shard=4, optim_shard=4, micro_batch=1,
                                             num_micro_batches=1, recompute="full"),
        "cp2-dp2-a2a-lins-2-2-4": Plan(cp=2, dp=2, cp_kind="all-to-all", param_shard=2, grad_shard=2, optim_shard=4,
                                       micro_batch=1, num_micro_batches=1),
        "cp2-tp2-sp-selective": Plan(cp=2, tp=2, sequence_parallel=True, micro_batch=2, num_micro_batches=1,
                                     recompute="selective"),
        "cp2-tp2-a2a": Plan(cp=2, tp=2, cp_kind="all-to-all", micro_batch=2, num_micro_batches=1),
        "cp2-pp2-1f1b": Plan(cp=2, pp=2, micro_batch=1, num_micro_batches=2),
    },
}
RANKS_PER_NODE = {"cp4-hierarchical": 2}
MODEL_CHANGES = {"gpt2-cp2-ring-full-recompute": {"arch": "gpt2", "num_kv_heads": 8},
                 "qwen-cp2-a2a": {"attention_head_dim": 16, "qkv_bias": True, "qk_norm": True}}
CASES = [(world, name) for world, plans in MATRIX.items() for name in plans]


def _config(world: int, name: str):
    return tiny_config(MATRIX[world][name], steps=4, ranks_per_node=RANKS_PER_NODE.get(name, 0),
                       **MODEL_CHANGES.get(name, {}))


_result = cached_matrix_results(MATRIX, _config)


@pytest.mark.parametrize("world,name", CASES, ids=[f"{w}procs-{n}" for w, n in CASES])
def test_context_parallel_matches_one_process(world, name):
    metrics, params = _result(world, name)
    check_against_reference(_config(world, name), metrics, params)
    if MATRIX[world][name].cp_kind != "all-to-all" or name == "cp4-hierarchical":
        assert metrics.summary.comm_bytes["p2p"] > 0, "the ring passed no K/V"
    if MATRIX[world][name].cp_kind != "ring":
        assert metrics.summary.comm_bytes["all_to_all"] > 0, "no all-to-all over heads"
