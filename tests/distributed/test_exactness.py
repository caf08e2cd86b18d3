"""The acceptance core: every kind of plan trains to the one-process losses (fp32, 1e-4) and parameters
(1e-2 of how far each tensor moved; harness.PARAM_TOL).

Plans of one world size share one set of gloo processes (start-up dominates these tiny runs); each plan
trains 8 steps of the tiny model from the same seeded weights and data as the reference, at one of the
three seeds in turn (harness.spread_seeds; all three with PLANNER_EXACTNESS_SEEDS=all). The first step's
gradients of every plan here are checked in test_gradients.py.
"""

import pytest

from specs.plan import Plan
from tests.distributed.harness import SEEDS, cached_matrix_results, check_against_reference, spread_seeds, tiny_config


def _z(dp: int, s_p: int, s_g: int, s_os: int, **kw) -> Plan:
    return Plan(dp=dp, param_shard=s_p, grad_shard=s_g, optim_shard=s_os, **kw)


MATRIX = {
    2: {
        "zero0-accum": _z(2, 1, 1, 1, micro_batch=1, num_micro_batches=3),
        "zero1": _z(2, 1, 1, 2, micro_batch=2, num_micro_batches=2),
        "zero2-accum": _z(2, 1, 2, 2, micro_batch=1, num_micro_batches=3),
        "zero3-full-recompute": _z(2, 2, 2, 2, micro_batch=2, num_micro_batches=2, recompute="full"),
        "tp2": Plan(tp=2, micro_batch=1, num_micro_batches=2),
        "tp2-sp-selective": Plan(tp=2, sequence_parallel=True, micro_batch=2, num_micro_batches=2, recompute="selective"),
        "pp2-gpipe": Plan(pp=2, schedule="gpipe", micro_batch=1, num_micro_batches=4),
        "pp2-1f1b-unequal": Plan(pp=2, schedule="1f1b", micro_batch=1, num_micro_batches=4, stage_layers=(3, 5)),
        "pp2-interleaved-unequal": Plan(pp=2, virtual_stages=2, schedule="interleaved-1f1b", micro_batch=1,
                                        num_micro_batches=4, stage_layers=(1, 3, 2, 2)),
    },
    4: {
        "zero0": _z(4, 1, 1, 1, micro_batch=1, num_micro_batches=2),
        "zero3-prefetch2": _z(4, 4, 4, 4, micro_batch=1, num_micro_batches=2, prefetch_depth=2),
        "hsdp-2x2": _z(4, 2, 2, 2, micro_batch=1, num_micro_batches=2),
        "mixed-2-2-4": _z(4, 2, 2, 4, micro_batch=1, num_micro_batches=2),
        "zero2-1-4-4-small-buckets": _z(4, 1, 4, 4, micro_batch=1, num_micro_batches=2, bucket_size_bytes=65536),
        "tp2-dp2-zero1-sp": Plan(dp=2, tp=2, optim_shard=2, sequence_parallel=True, micro_batch=1, num_micro_batches=2),
        "pp2-dp2-1f1b-zero2": Plan(dp=2, pp=2, grad_shard=2, optim_shard=2, micro_batch=1, num_micro_batches=4),
        "pp4-1f1b": Plan(pp=4, micro_batch=1, num_micro_batches=4),
    },
    8: {
        "pp2-dp2-tp2": Plan(dp=2, tp=2, pp=2, param_shard=2, grad_shard=2, optim_shard=2, micro_batch=1,
                            num_micro_batches=4, sequence_parallel=True),
    },
}
RANKS_PER_NODE = {"hsdp-2x2": 2, "mixed-2-2-4": 2}

QWEN = {"attention_head_dim": 16, "qkv_bias": True, "qk_norm": True}

# Model variants on 2 processes: GPT-2's blocks under TP + SP, and tied embeddings. The reference shares
# one Parameter; so does the engine where both ends are on one rank and the weight is never sharded away
# (ZeRO-2); elsewhere it keeps two copies whose reduced gradients it sums, on one rank (pp=1, sharded
# parameters) and across the first and last pipeline stage (pp=2).
MODEL_VARIANTS = {
    "gpt2-tp2-sp-full-recompute": (Plan(tp=2, sequence_parallel=True, micro_batch=2, num_micro_batches=2,
                                        recompute="full"), {"arch": "gpt2", "num_kv_heads": 8}),
    "tied-zero2-shared": (_z(2, 1, 2, 2, micro_batch=2, num_micro_batches=2), {"tied_embeddings": True}),
    "tied-zero3": (_z(2, 2, 2, 2, micro_batch=2, num_micro_batches=2), {"tied_embeddings": True}),
    "tied-pp2-1f1b": (Plan(pp=2, micro_batch=1, num_micro_batches=4, schedule="1f1b"), {"tied_embeddings": True}),
    # Qwen's attention: an explicit head_dim (q width 8 x 16 = 128 on hidden 64), q/k/v biases (Qwen2) and
    # per-head query/key RMSNorms (Qwen3), whose shared weights sum their gradients over TP with and without SP.
    "qwen-tp2": (Plan(tp=2, micro_batch=1, num_micro_batches=2), QWEN),
    "qwen-tp2-sp-selective": (Plan(tp=2, sequence_parallel=True, micro_batch=2, num_micro_batches=2,
                                   recompute="selective"), QWEN),
    "qwen-zero3": (_z(2, 2, 2, 2, micro_batch=2, num_micro_batches=2), QWEN),
}


def _config(world: int, name: str, seed: int = SEEDS[0]):
    return tiny_config(MATRIX[world][name], ranks_per_node=RANKS_PER_NODE.get(name, 0), seed=seed)


def variant_config(name: str, seed: int = SEEDS[0]):
    plan, changes = MODEL_VARIANTS[name]
    return tiny_config(plan, seed=seed, **changes)


def _any_config(world: int, name: str, seed: int):
    return variant_config(name, seed) if name in MODEL_VARIANTS else _config(world, name, seed)


PLAN_NAMES = [(world, name) for world, plans in MATRIX.items() for name in plans] + [(2, n) for n in MODEL_VARIANTS]
CASES = [(world, name, seed) for (world, name), seed in spread_seeds(PLAN_NAMES)]
_result = cached_matrix_results({w: [(n, s) for ww, n, s in CASES if ww == w] for w in MATRIX},
                                lambda world, key: _any_config(world, *key))


@pytest.mark.parametrize("world,name,seed", CASES, ids=[f"{w}procs-{n}-seed{s}" for w, n, s in CASES])
def test_plan_matches_one_process(world, name, seed):
    metrics, params = _result(world, (name, seed))
    check_against_reference(_any_config(world, name, seed), metrics, params)
