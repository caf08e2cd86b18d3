"""--engine torch trains every plan it expresses to the one-process losses and parameters
(harness.check_against_reference), and names the knob of every plan it cannot express.

Plans of one world size share one set of gloo processes, as in test_exactness.py, each at one of
harness.SEEDS in turn; test_gradients.py checks every plan's first-step gradients.
"""

import pytest

from specs.errors import PlannerError
from specs.plan import Plan
from runners.torch_engine import torch_strategy
from tests.distributed.harness import SEEDS, cached_matrix_results, check_against_reference, spread_seeds, tiny_config


def _z(dp: int, s_p: int, s_g: int, s_os: int, **kw) -> Plan:
    return Plan(dp=dp, param_shard=s_p, grad_shard=s_g, optim_shard=s_os, **kw)


MATRIX = {
    2: {
        "ddp-accum": (_z(2, 1, 1, 1, micro_batch=1, num_micro_batches=3), "ddp"),
        "zero1-accum": (_z(2, 1, 1, 2, micro_batch=2, num_micro_batches=2), "zero1"),
        "zero2-accum": (_z(2, 1, 2, 2, micro_batch=1, num_micro_batches=3), "zero2"),
        "zero3-accum-full-recompute": (_z(2, 2, 2, 2, micro_batch=2, num_micro_batches=2, recompute="full"), "zero3"),
        "zero3-per-layer-recompute": (_z(2, 2, 2, 2, micro_batch=1, num_micro_batches=2,
                                         recompute_layers=("full", "selective", "none", "none") * 2), "zero3"),
        "ddp-tied": (_z(2, 1, 1, 1, micro_batch=1, num_micro_batches=2), "ddp", {"tied_embeddings": True}),
        "zero3-tied-gpt2": (_z(2, 2, 2, 2, micro_batch=1, num_micro_batches=2), "zero3",
                            {"tied_embeddings": True, "arch": "gpt2", "num_kv_heads": 8}),
        # Qwen's attention on torch's FSDP2 (head_dim 16 on hidden 64, q/k/v biases, query/key head norms),
        # and Qwen2's biases under DTensor TP (the head norms are refused there: the last test).
        "zero3-qwen": (_z(2, 2, 2, 2, micro_batch=2, num_micro_batches=1), "zero3",
                       {"attention_head_dim": 16, "qkv_bias": True, "qk_norm": True}),
        "tp2-qwen2": (Plan(tp=2, micro_batch=1, num_micro_batches=2), "tp", {"qkv_bias": True}),
        "pp2-gpipe": (Plan(pp=2, schedule="gpipe", micro_batch=1, num_micro_batches=4), "pipeline"),
        "pp2-1f1b-unequal": (Plan(pp=2, schedule="1f1b", micro_batch=1, num_micro_batches=4, stage_layers=(3, 5)),
                             "pipeline"),
        "pp2-interleaved-unequal": (Plan(pp=2, virtual_stages=2, schedule="interleaved-1f1b", micro_batch=1,
                                         num_micro_batches=4, stage_layers=(1, 3, 2, 2)), "pipeline"),
        "tp2": (Plan(tp=2, micro_batch=1, num_micro_batches=2), "tp"),
        "tp2-sp-selective": (Plan(tp=2, sequence_parallel=True, micro_batch=2, num_micro_batches=2,
                                  recompute="selective"), "tp"),
        "tp2-sp-full-recompute-tied-gpt2": (Plan(tp=2, sequence_parallel=True, micro_batch=2, num_micro_batches=2,
                                                 recompute="full"), "tp",
                                            {"tied_embeddings": True, "arch": "gpt2", "num_kv_heads": 8}),
    },
    4: {
        "hsdp-2x2-accum": (_z(4, 2, 2, 2, micro_batch=1, num_micro_batches=2), "hsdp"),
        "zero3-4-accum": (_z(4, 4, 4, 4, micro_batch=1, num_micro_batches=2), "zero3"),
        "pp4-1f1b-selective": (Plan(pp=4, micro_batch=1, num_micro_batches=4, recompute="selective"), "pipeline"),
        "tp2-dp2-zero3-sp": (Plan(dp=2, tp=2, param_shard=2, grad_shard=2, optim_shard=2, sequence_parallel=True,
                                  micro_batch=1, num_micro_batches=2), "zero3"),
        "tp2-dp2-zero0": (Plan(dp=2, tp=2, micro_batch=1, num_micro_batches=2), "ddp"),
        "pp2-dp2-1f1b-zero0": (Plan(dp=2, pp=2, micro_batch=1, num_micro_batches=4), "pipeline"),
        "pp2-dp2-interleaved-zero2": (Plan(dp=2, pp=2, virtual_stages=2, schedule="interleaved-1f1b", grad_shard=2,
                                           optim_shard=2, micro_batch=1, num_micro_batches=4), "pipeline"),
        "pp2-tp2-gpipe-sp": (Plan(pp=2, tp=2, sequence_parallel=True, schedule="gpipe", micro_batch=1,
                                  num_micro_batches=4), "pipeline"),
    },
}
CASES = [(world, name, seed) for (world, name), seed in
         spread_seeds([(world, name) for world, plans in MATRIX.items() for name in plans])]


def _config(world: int, name: str, seed: int = SEEDS[0]):
    plan, _, *model_changes = MATRIX[world][name]
    return tiny_config(plan, engine="torch", seed=seed, **(model_changes[0] if model_changes else {}))


_result = cached_matrix_results({w: [(n, s) for ww, n, s in CASES if ww == w] for w in MATRIX},
                                lambda world, key: _config(world, *key))


@pytest.mark.parametrize("world,name,seed", CASES, ids=[f"{w}procs-{n}-seed{s}" for w, n, s in CASES])
def test_torch_engine_matches_one_process(world, name, seed):
    plan, strategy = MATRIX[world][name][:2]
    assert torch_strategy(plan) == strategy  # the plan really ran on the torch component named
    metrics, params = _result(world, (name, seed))
    check_against_reference(_config(world, name, seed), metrics, params)
    summary = metrics.summary
    assert summary.engine == "torch" and summary.comm_counted is False
    assert all(v == 0 for v in summary.comm_bytes.values())


@pytest.mark.parametrize("plan,knob", [
    (Plan(dp=2, tp=2, optim_shard=2, micro_batch=1, num_micro_batches=2), r"ZeRO-1.*tensor parallelism"),
    (Plan(dp=2, pp=2, optim_shard=2, micro_batch=1, num_micro_batches=2), r"ZeRO-1.*pipeline parallelism"),
    (_z(4, 2, 2, 4), r"\(2, 2, 4\)"),
    (_z(4, 1, 2, 4), r"\(1, 2, 4\)"),
    (_z(2, 2, 2, 2, param_cache="device"), "param_cache"),
    (Plan(dp=2, pp=2, commshift=True, micro_batch=1, num_micro_batches=2), "commshift"),
])
def test_inexpressible_plan_is_rejected_naming_the_knob(plan, knob):
    with pytest.raises(PlannerError, match=knob):
        torch_strategy(plan)


def test_commshift_alone_is_named():
    # With pp 1 commshift only warns in Plan; the torch engine still refuses it by name.
    with pytest.warns(UserWarning):
        plan = Plan(dp=2, commshift=True)
    with pytest.raises(PlannerError, match="commshift"):
        torch_strategy(plan)


def test_head_norms_under_tensor_parallelism_are_refused_in_one_line():
    from runners.torch_engine import make_torch_trainer

    cfg = tiny_config(Plan(tp=2, micro_batch=1, num_micro_batches=2), engine="torch", qk_norm=True)
    with pytest.raises(PlannerError, match=r"qk_norm\) under tensor parallelism \(tp 2\); use engine ours"):
        make_torch_trainer(cfg, device=None)
