"""planner export: the generated torchtitan TOML, Megatron-LM arguments and DeepSpeed JSON, and the
knobs each target cannot express."""

from __future__ import annotations

import json
import shlex
import tomllib

import pytest

from specs.errors import PlannerError
from planner.export import export_plan
from specs.job import Job
from specs.model import resolve_model
from specs.plan import Plan

MODEL = resolve_model("llama3-8b")
JOB = Job(global_batch=64, seq_len=4096)


def _plan(**kw):
    base = dict(dp=4, tp=2, pp=2, micro_batch=1, num_micro_batches=16)
    base.update(kw)
    return Plan(**base)


def _megatron_args(text: str) -> dict:
    tokens = shlex.split(text.replace("\\\n", " "))
    args, i = {}, tokens.index("pretrain_gpt.py") + 1
    while i < len(tokens):
        if i + 1 < len(tokens) and not tokens[i + 1].startswith("--"):
            args[tokens[i]] = tokens[i + 1]
            i += 2
        else:
            args[tokens[i]] = True
            i += 1
    return args


def test_torchtitan_toml_degrees_batches_schedule_and_checkpointing():
    plan = _plan(virtual_stages=2, schedule="interleaved-1f1b", sequence_parallel=True, param_shard=4, grad_shard=4,
                 optim_shard=4, recompute="full")
    out = export_plan(plan, model=MODEL, job=JOB, target="torchtitan")
    toml = tomllib.loads(out.text)
    par = toml["parallelism"]
    assert (par["data_parallel_replicate_degree"], par["data_parallel_shard_degree"]) == (1, 4)
    assert (par["tensor_parallel_degree"], par["pipeline_parallel_degree"]) == (2, 2)
    assert par["pipeline_parallel_schedule"] == "Interleaved1F1B" and par["pipeline_parallel_microbatch_size"] == 1
    assert par["pipeline_parallel_layers_per_stage"] == 32 // 4
    # Per-DP-rank batch times DP is the global batch.
    assert toml["training"]["local_batch_size"] * 4 == toml["training"]["global_batch_size"] == 64
    assert toml["activation_checkpoint"]["mode"] == "full"
    assert out.unsupported == ()


def test_torchtitan_hsdp_ddp_and_unequal_stages():
    hsdp = export_plan(_plan(tp=1, pp=1, dp=16, num_micro_batches=4, param_shard=4, grad_shard=4, optim_shard=4),
                       model=MODEL, job=JOB, target="torchtitan")
    par = tomllib.loads(hsdp.text)["parallelism"]
    assert (par["data_parallel_replicate_degree"], par["data_parallel_shard_degree"]) == (4, 4)
    ddp = tomllib.loads(export_plan(_plan(tp=1, pp=1, dp=16, num_micro_batches=4), model=MODEL, job=JOB,
                                    target="torchtitan").text)
    assert (ddp["parallelism"]["data_parallel_replicate_degree"], ddp["parallelism"]["data_parallel_shard_degree"]) == (16, 1)
    # Without PP torchtitan accumulates: local batch is one micro-batch, global 64 = 1 x 16 DP x 4 steps.
    assert ddp["training"]["local_batch_size"] == 1 and ddp["training"]["global_batch_size"] == 64
    unequal = export_plan(_plan(pp=4, dp=2, num_micro_batches=32, stage_layers=(7, 9, 9, 7)), model=MODEL, job=JOB,
                          target="torchtitan")
    assert tomllib.loads(unequal.text)["parallelism"]["pipeline_parallel_split_points"] == ["layers.7", "layers.16", "layers.25"]


def test_megatron_arguments():
    plan = _plan(virtual_stages=2, schedule="interleaved-1f1b", sequence_parallel=True, optim_shard=4, recompute="selective")
    out = export_plan(plan, model=MODEL, job=JOB, target="megatron")
    args = _megatron_args(out.text)
    assert args["--tensor-model-parallel-size"] == "2" and args["--pipeline-model-parallel-size"] == "2"
    assert args["--num-layers-per-virtual-pipeline-stage"] == "8"
    assert args["--micro-batch-size"] == "1" and args["--global-batch-size"] == "64"
    assert args["--sequence-parallel"] is True and args["--use-distributed-optimizer"] is True
    assert args["--recompute-granularity"] == "selective" and args["--num-query-groups"] == "8"
    assert out.unsupported == ()
    firstlast = _megatron_args(export_plan(_plan(pp=4, dp=2, num_micro_batches=32, stage_layers=(7, 9, 9, 7)),
                                           model=MODEL, job=JOB, target="megatron").text)
    assert firstlast["--decoder-first-pipeline-num-layers"] == "7" and firstlast["--decoder-last-pipeline-num-layers"] == "7"
    ragged = export_plan(_plan(pp=4, dp=2, num_micro_batches=32, stage_layers=(8, 7, 9, 8)), model=MODEL, job=JOB,
                         target="megatron")
    assert any("unequal stages [8, 7, 9, 8]" in u for u in ragged.unsupported)


def test_deepspeed_json_batch_identity_and_zero_stage():
    plan = _plan(tp=1, pp=1, dp=16, micro_batch=2, num_micro_batches=2, param_shard=1, grad_shard=16, optim_shard=16)
    out = export_plan(plan, model=MODEL, job=JOB, target="deepspeed")
    cfg = json.loads(out.text)
    assert cfg["train_batch_size"] == cfg["train_micro_batch_size_per_gpu"] * cfg["gradient_accumulation_steps"] * 16
    assert cfg["zero_optimization"]["stage"] == 2 and cfg["bf16"]["enabled"] is True
    mics = json.loads(export_plan(_plan(tp=1, pp=1, dp=16, num_micro_batches=4, param_shard=8, grad_shard=8,
                                        optim_shard=8, param_cache="secondary"), model=MODEL, job=JOB,
                                  target="deepspeed").text)
    assert mics["zero_optimization"]["mics_shard_size"] == 8 and "zero_hpz_partition_size" in mics["zero_optimization"]


def test_knobs_the_targets_cannot_express_are_listed():
    # A Lins mixed point (parameters over 2, gradients and optimizer over 4), a MAZ3 host tier, commshift.
    plan = _plan(param_shard=2, grad_shard=4, optim_shard=4, param_cache="host", commshift=True, schedule="gpipe")
    for target in ("torchtitan", "megatron", "deepspeed"):
        unsupported = " | ".join(export_plan(plan, model=MODEL, job=JOB, target=target).unsupported)
        assert "shard degrees (2, 4, 4)" in unsupported, target
        assert "commshift" in unsupported and "host" in unsupported, target
    assert any("gpipe" in u for u in export_plan(plan, model=MODEL, job=JOB, target="megatron").unsupported)
    with pytest.raises(PlannerError, match="--to must be one of torchtitan, megatron, deepspeed"):
        export_plan(plan, model=MODEL, job=JOB, target="jax")
