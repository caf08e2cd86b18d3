"""planner export: what each target is given (torchtitan's config module, Megatron-LM's arguments, DeepSpeed's
JSON), what each cannot express, what each refuses; Megatron-LM's argument rules against outcomes recorded
from its own code. (tests/integration/test_exports_accepted.py loads every export through the targets' code.)"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from planner.exports import Refused, export_plan
from planner.exports.common import short
from planner.exports.megatron import pipeline_layout
from planner.exports.megatron_rules import megatron_violations, parse_layout
from specs.errors import PlannerError
from specs.model import PRESETS as PRESETS_MODELS
from specs.plan import Plan
from specs.problem import make_problem
from tests.export_cases import CASES

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "megatron"
FLAG_LISTS = {name: json.loads((FIXTURES / f"flags_{name}.json").read_text())["flags"]
              for name in ("core_v0.16.1", "main_0.20.0")}
LLAMA70 = make_problem(model="llama3-70b", hardware="h100", gpus=64, gpus_per_node=8, global_batch=64, seq_len=4096)


def _export(plan: Plan, target: str, problem=LLAMA70):
    return export_plan(plan, problem, target=target)[0]


def _plan(**kw) -> Plan:
    base = dict(dp=8, tp=8, micro_batch=1, num_micro_batches=8)
    base.update(kw)
    return Plan(**base)


def _argv_to_args(argv: list[str], flags: dict) -> dict:
    """argparse's reading of an argv, from the flag list's nargs (unknown flags raise KeyError)."""
    args, i = {}, 0
    while i < len(argv):
        spec = flags[argv[i]]
        if spec["nargs"] == 0:
            args[argv[i]], i = True, i + 1
        elif spec["nargs"] == "+":
            j = i + 1
            while j < len(argv) and not argv[j].startswith("--"):
                j += 1
            args[argv[i]], i = " ".join(argv[i + 1:j]), j
        else:
            args[argv[i]], i = argv[i + 1], i + 2
    return args


def test_megatron_rules_agree_with_megatrons_own_checks():
    recorded = json.loads((FIXTURES / "validate_args_cases.json").read_text())
    flags = FLAG_LISTS["main_0.20.0"]
    assert len(recorded["cases"]) == 42
    for case in recorded["cases"]:
        argv = recorded["base_argv"] + case["extra_argv"]
        try:
            args = _argv_to_args(argv, flags)
        except KeyError:
            accepted = False  # argparse: unrecognized arguments
        else:
            accepted = not megatron_violations(args, world_size=case["world_size"], env=case["env"], runtime=False)
        assert accepted == case["accepted"], (case["name"], case["outcome"])


def _flag_value_ok(spec: dict, value) -> bool:
    if value is True:
        return spec["nargs"] == 0
    if spec["nargs"] == 0:
        return False
    if spec["choices"] is not None and str(value) not in spec["choices"]:
        return False
    kind = {"int": int, "float": float}.get(spec["type"], str)
    # A list flag (nargs '+') takes its values space-separated, as the launch script writes them.
    for item in str(value).split() if spec["nargs"] == "+" else [value]:
        kind(item)
    return True


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_megatron_exports_use_real_flags_and_pass_its_rules(case):
    result = _export(case.build_plan(), "megatron", case.problem())
    args, env = result.settings["args"], result.settings["env"]
    for name, flags in FLAG_LISTS.items():
        for flag, value in args.items():
            assert flag in flags, f"{flag} is not a Megatron-LM {name} flag"
            assert _flag_value_ok(flags[flag], value), (flag, value, flags[flag])
    assert megatron_violations(args, world_size=case.gpus, env={k: v for k, v in env.items() if v}) == []
    text = result.files["launch.sh"]
    assert result.version in text and "<" not in text  # a version, and no placeholder a shell would redirect
    assert f"--nproc-per-node 8 --nnodes {case.gpus // 8}" in text


def test_megatron_model_flags_are_the_models():
    args = _export(_plan(sequence_parallel=True, optim_shard=8), "megatron").settings["args"]
    assert args["--rotary-base"] == 500000 and args["--position-embedding-type"] == "rope"
    assert args["--attention-dropout"] == 0.0 == args["--hidden-dropout"]
    assert args["--num-query-groups"] == 8 and args["--group-query-attention"] is True
    assert args["--tokenizer-type"] == "NullTokenizer" and args["--vocab-size"] == 128256
    # Megatron pads the vocabulary to a multiple of divisor x TP: 32 x 8 divides 128256, so no padding.
    assert 128256 % (args["--make-vocab-size-divisible-by"] * 8) == 0
    assert "--untie-embeddings-and-output-weights" in args and args["--weight-decay"] == 0.0


def test_megatron_sharding_and_its_environment():
    zero1 = _export(_plan(optim_shard=8), "megatron").settings
    assert "--use-distributed-optimizer" in zero1["args"] and zero1["env"] == {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    partial = _export(_plan(optim_shard=4), "megatron").settings["args"]
    assert partial["--num-distributed-optimizer-instances"] == 2
    zero3 = _export(_plan(param_shard=8, grad_shard=8, optim_shard=8), "megatron").settings
    assert zero3["args"]["--data-parallel-sharding-strategy"] == "optim_grads_params"
    assert zero3["args"]["--ckpt-format"] == "fsdp_dtensor" and "--use-torch-fsdp2" not in zero3["args"]
    assert zero3["env"] == {"CUDA_DEVICE_MAX_CONNECTIONS": ""}
    # A Lins mix (4, 8, 8) is exported as the Megatron point that shards each state at least as much
    # (never as the distributed optimizer, which would need far more memory), and says so.
    mix = _export(_plan(param_shard=4, grad_shard=8, optim_shard=8), "megatron")
    assert mix.expressed.shard_degrees == (8, 8, 8)
    assert any("shard degrees (4, 8, 8)" in line and "ZeRO-3 (8, 8, 8)" in line for line in mix.cannot_express)


def test_megatron_layout_expresses_every_stage_split():
    unequal = Plan(dp=4, tp=8, pp=4, micro_batch=1, num_micro_batches=32, stage_layers=(19, 21, 21, 19))
    assert pipeline_layout(unequal, 80) == "Et*19|t*21|t*21|t*19L"
    interleaved = Plan(dp=1, pp=2, virtual_stages=2, schedule="interleaved-1f1b", micro_batch=1, num_micro_batches=8,
                       stage_layers=(1, 3, 2, 2))
    layout = pipeline_layout(interleaved, 8)
    assert layout == "Et|t*3|t*2|t*2L" and [s.count("t") for s in parse_layout(layout)] == [1, 3, 2, 2]


def test_torchtitan_settings():
    interleaved = _export(Plan(dp=2, tp=8, pp=4, virtual_stages=2, schedule="interleaved-1f1b", micro_batch=1,
                               num_micro_batches=32, optim_shard=2, sequence_parallel=True), "torchtitan")
    par, training = interleaved.settings["parallelism"], interleaved.settings["training"]
    parts = par["module_fqns_per_model_part"]
    assert len(parts) == 8 and parts[0][:2] == ["tok_embeddings", "layers.0"] and parts[-1][-2:] == ["norm", "lm_head"]
    assert [len([n for n in p if n.startswith("layers.")]) for p in parts] == [10] * 8
    assert par["pipeline_parallel_schedule"] == "Interleaved1F1B" and training["disable_cuda_graphs"] is True
    # ZeRO-1 runs as FSDP2 that keeps the gathered parameters until backward, said in one line.
    assert par["fsdp_reshard_after_forward"] == "never" and interleaved.expressed.param_cache == "device"
    assert training["local_batch_size"] * 2 == training["global_batch_size"] == 64
    assert "Interleaved1F1B" in interleaved.files["planner_plan.py"] and interleaved.version in interleaved.files["launch.sh"]
    hsdp = _export(_plan(param_shard=4, grad_shard=4, optim_shard=4), "torchtitan").settings["parallelism"]
    assert (hsdp["data_parallel_replicate_degree"], hsdp["data_parallel_shard_degree"]) == (2, 4)
    assert hsdp["fsdp_reshard_after_forward"] == "always" and hsdp["enable_sequence_parallel"] is False
    ddp = _export(_plan(), "torchtitan").settings
    assert (ddp["parallelism"]["data_parallel_shard_degree"], ddp["training"]["local_batch_size"]) == (1, 1)


def test_torchtitan_refuses_what_it_would_reject_naming_the_closest_plan():
    tied = make_problem(model="llama3.2-1b", hardware="h100", gpus=16, gpus_per_node=8, global_batch=64, seq_len=8192)
    with pytest.raises(Refused, match=r"Weight tying is not supported with Pipeline Parallel.*closest plan it accepts "
                                      r"is dp16 tp1 pp1 .*GiB per device"):
        _export(Plan(dp=8, pp=2, micro_batch=1, num_micro_batches=8), "torchtitan", tied)
    gpt = make_problem(model="gpt3-1.7b", hardware="a100", gpus=8, gpus_per_node=8, global_batch=8, seq_len=2048)
    with pytest.raises(Refused, match="no gpt2 decoder"):
        _export(Plan(dp=8), "torchtitan", gpt)
    few = Plan(dp=16, pp=4, micro_batch=1, num_micro_batches=2)
    with pytest.raises(Refused, match=r"Schedule1F1B needs at least as many micro-batches.*is dp16 tp1 pp4 mb1x2 gpipe"):
        _export(few, "torchtitan", make_problem(model="llama3-8b", hardware="h100", gpus=64, gpus_per_node=8,
                                                global_batch=32, seq_len=4096))


def test_deepspeed_config_and_refusal():
    zero2 = _export(_plan(grad_shard=8, optim_shard=8, micro_batch=2, num_micro_batches=4), "deepspeed")
    config = zero2.settings["ds_config"]
    assert config["train_batch_size"] == 2 * 4 * 8 and config["zero_optimization"]["stage"] == 2
    assert config["optimizer"]["type"] == "Adam" and config["optimizer"]["params"]["adam_w_mode"] is False
    assert config["tensor_parallel"] == {"autotp_size": 8}
    assert json.loads(zero2.files["config.json"])["rope_theta"] == 500000.0
    hsdp = _export(_plan(param_shard=4, grad_shard=4, optim_shard=4, param_cache="secondary"), "deepspeed")
    zero = hsdp.settings["ds_config"]["zero_optimization"]
    assert zero["stage"] == 3 and zero["zero_hpz_partition_size"] == 1 and "mics_shard_size" not in zero
    with pytest.raises(Refused, match=r"ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism.*closest plan "
                                      r"it accepts is dp4 tp8 pp2 mb1x16 1f1b rc=none zero1"):
        _export(Plan(dp=4, tp=8, pp=2, micro_batch=1, num_micro_batches=16, sequence_parallel=True, param_shard=4,
                     grad_shard=4, optim_shard=4), "deepspeed")


def test_qwen_attention_is_the_models_in_every_target_and_qwen2s_biases_refused_by_torchtitan():
    qwen3 = make_problem(model="qwen3-8b", hardware="h100", gpus=8, gpus_per_node=8, global_batch=16, seq_len=4096)
    qwen2 = make_problem(model="qwen2.5-7b", hardware="h100", gpus=8, gpus_per_node=8, global_batch=16, seq_len=4096)
    plan = Plan(dp=8, micro_batch=1, num_micro_batches=2)
    args = _export(plan, "megatron", qwen3).settings["args"]
    assert args["--qk-layernorm"] is True and args["--kv-channels"] == 128 and "--add-qkv-bias" not in args
    assert _export(plan, "megatron", qwen2).settings["args"]["--add-qkv-bias"] is True
    for problem, model_type, keys in ((qwen3, "qwen3", {"head_dim": 128, "attention_bias": False}),
                                      (qwen2, "qwen2", {"use_sliding_window": False})):
        config = json.loads(_export(plan, "deepspeed", problem).files["config.json"])
        assert config["model_type"] == model_type and keys.items() <= config.items()
    with pytest.raises(Refused, match="q/k/v biases"):
        _export(plan, "torchtitan", qwen2)
    # Qwen's RoPE base (1e6), in every target.
    assert args["--rotary-base"] == 1000000
    assert json.loads(_export(plan, "deepspeed", qwen3).files["config.json"])["rope_theta"] == 1e6
    module = _export(plan, "torchtitan", qwen3).files["planner_plan.py"]  # torchtitan's qwen3 decoder
    assert re.search(r"ROPE_THETA, ROPE_MAX_SEQ_LEN, NORM_EPS, QK_NORM = \w+, 1000000\.0,", module)
    assert "Qwen3Model.Config(" in module and "HEAD_DIM" in module and "QK_NORM = " in module
    assert re.search(r"QK_NORM = .*True", module)
    # Qwen's norm epsilon (1e-6, Llama's 1e-5), in every target.
    assert args["--norm-epsilon"] == 1e-6 and re.search(r"NORM_EPS, QK_NORM = .*, 1e-06, True", module)
    assert json.loads(_export(plan, "deepspeed", qwen2).files["config.json"])["rms_norm_eps"] == 1e-6
    llama = make_problem(model="llama3-8b", hardware="h100", gpus=8, gpus_per_node=8, global_batch=16, seq_len=4096)
    assert _export(plan, "megatron", llama).settings["args"]["--norm-epsilon"] == 1e-5
    both = dataclasses.replace(qwen3, model=dataclasses.replace(qwen3.model, name="qwen-both", qkv_bias=True))
    with pytest.raises(Refused, match="no HF architecture has both"):
        _export(plan, "deepspeed", both)


def test_llama31_rope_scaling_is_the_models_in_every_target():
    problem = make_problem(model="llama3.1-8b", hardware="h100", gpus=8, gpus_per_node=8, global_batch=16, seq_len=8192)
    plan = Plan(dp=8, micro_batch=1, num_micro_batches=2, param_shard=8, grad_shard=8, optim_shard=8)
    args = _export(plan, "megatron", problem).settings["args"]
    assert args["--use-rope-scaling"] is True and args["--rope-scaling-factor"] == 8.0
    module = _export(plan, "torchtitan", problem).files["planner_plan.py"]
    assert ("ROPE_SCALING = {'scaling': 'llama', 'scaling_factor': 8.0, 'low_freq_factor': 1.0, 'high_freq_factor': "
            "4.0, 'original_max_position_embeddings': 8192}") in module
    assert "theta=ROPE_THETA, **ROPE_SCALING)" in module
    config = json.loads(_export(plan, "deepspeed", problem).files["config.json"])
    assert config["rope_scaling"] == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    unscaled = make_problem(model="llama3-8b", hardware="h100", gpus=8, gpus_per_node=8, global_batch=16, seq_len=8192)
    assert "--use-rope-scaling" not in _export(plan, "megatron", unscaled).settings["args"]
    assert "ROPE_SCALING = {'scaling': 'none'}" in _export(plan, "torchtitan", unscaled).files["planner_plan.py"]
    # HF's other scalings are kept by name only: refused where a config must carry their parameters, said otherwise.
    yarn = dataclasses.replace(problem, model=dataclasses.replace(problem.model, rope_scaling="yarn"))
    for target, message in (("deepspeed", "yarn rope scaling's parameters are not kept"),
                            ("torchtitan", "yarn rope scaling")):
        with pytest.raises(Refused, match=message):
            _export(plan, target, yarn)
    assert any("yarn scaling is not exported" in note for note in _export(plan, "megatron", yarn).notes)


def test_gpt2_gelu_is_the_models_or_said():
    gpt = make_problem(model="gpt3-1.7b", hardware="a100", gpus=8, gpus_per_node=8, global_batch=8, seq_len=2048)
    tanh = dataclasses.replace(gpt, model=dataclasses.replace(gpt.model, gelu_approximation="tanh"))
    plan = Plan(dp=8, micro_batch=1, num_micro_batches=1)
    for problem, hf_name in ((gpt, "gelu"), (tanh, "gelu_new")):
        assert json.loads(_export(plan, "deepspeed", problem).files["config.json"])["activation_function"] == hf_name
    assert not any("GELU" in note for note in _export(plan, "megatron", gpt).notes)
    notes = _export(plan, "megatron", tanh).notes
    assert any(note.startswith("GELU: Megatron-Core's GPT model runs exact") for note in notes)


def test_knobs_a_target_cannot_express_are_one_line_each_from_the_knob_table():
    plan = _plan(pp=1, param_shard=8, grad_shard=8, optim_shard=8, prefetch_depth=3, param_cache="host",
                 bucket_size_bytes=100 * 2**20, recompute_layers=("full",) * 60 + ("none",) * 20)
    for target in ("torchtitan", "megatron", "deepspeed"):
        result = _export(plan, target)
        lines = " | ".join(result.cannot_express)
        assert "param_cache='host'" in lines and "MAZ3 tier" in lines, target
        assert "per-layer (60 full, 20 none)" in lines and "'full'" in lines, target
        assert result.expressed.recompute == "full" and result.expressed.param_cache == "none"
        assert all("\n" not in line for line in result.cannot_express)
    # Megatron has no prefetch depth and torchtitan's FSDP2 no buckets; DeepSpeed has both.
    assert "prefetch_depth=3" in " ".join(_export(plan, "megatron").cannot_express)
    assert "bucket_size_bytes" in " ".join(_export(plan, "torchtitan").cannot_express)
    assert not any("prefetch" in line or "bucket" in line for line in _export(plan, "deepspeed").cannot_express)
    commshift = Plan(dp=8, pp=2, micro_batch=1, num_micro_batches=8, optim_shard=8, commshift=True)
    problem = make_problem(model="llama3-8b", hardware="h100", gpus=16, gpus_per_node=8, global_batch=64, seq_len=4096)
    for target in ("torchtitan", "megatron", "deepspeed"):
        result = _export(commshift, target, problem)
        assert any(line.startswith("commshift=True") for line in result.cannot_express)
        assert result.expressed.commshift is False


def test_targets_are_named_in_any_case_and_unknown_ones_refused():
    assert _export(_plan(), "Megatron").target == "megatron"
    with pytest.raises(PlannerError, match="--to must be one of torchtitan, megatron, deepspeed"):
        _export(_plan(), "jax")
    assert short(("full",) * 20 + ("none",) * 12) == "per-layer (20 full, 12 none)"


def test_gradient_reduction_dtype_is_expressed_as_each_target_can():
    """reduce_fp32 (fp32 gradient accumulation and reduction under bf16): Megatron's default unless
    --grad-reduce-in-bf16; torchtitan reduces in float32 only; DeepSpeed accumulates in fp32 only on ZeRO-1."""
    bf16, fp32 = _plan(optim_shard=8), _plan(optim_shard=8, reduce_fp32=True)
    args = _export(bf16, "megatron").settings["args"]
    assert args["--grad-reduce-in-bf16"] is True and args["--ddp-bucket-size"] == bf16.bucket_size_bytes // 2
    args = _export(fp32, "megatron").settings["args"]
    assert "--grad-reduce-in-bf16" not in args and args["--ddp-bucket-size"] == fp32.bucket_size_bytes // 4
    titan = _export(bf16, "torchtitan")
    assert titan.expressed.reduce_fp32 and any(line.startswith("reduce_fp32=False") for line in titan.cannot_express)
    assert titan.settings["training"]["mixed_precision_reduce"] == "float32"
    assert not any("reduce_fp32" in line for line in _export(fp32, "torchtitan").cannot_express)
    zero1 = _export(fp32, "deepspeed")
    assert zero1.expressed.reduce_fp32 and zero1.settings["ds_config"]["data_types"] == {"grad_accum_dtype": "fp32"}
    assert zero1.settings["ds_config"]["communication_data_type"] == "fp32"
    zero2 = _export(_plan(grad_shard=8, optim_shard=8, reduce_fp32=True), "deepspeed")
    assert not zero2.expressed.reduce_fp32 and "data_types" not in zero2.settings["ds_config"]
    assert any(line.startswith("reduce_fp32=True") for line in zero2.cannot_express)


def test_torchtitan_writes_moe_models_on_its_qwen3_decoder_with_expert_parallelism():
    problem = make_problem(model="qwen3-30b-a3b", hardware="h100", gpus=16, gpus_per_node=8, global_batch=64,
                           seq_len=4096)
    plan = Plan(dp=16, ep=8, etp=1, micro_batch=1, num_micro_batches=4, param_shard=16, grad_shard=16, optim_shard=16)
    result = _export(plan, "torchtitan", problem)
    assert result.settings["parallelism"]["expert_parallel_degree"] == 8
    assert result.settings["training"]["disable_cuda_graphs"] is True  # its all-to-all dispatcher syncs the CPU
    module = result.files["planner_plan.py"]
    assert "NUM_EXPERTS, TOP_K, EXPERT_FFN_DIM, SHARED_FFN_DIM, DENSE_LAYERS = (128, 8, 768," in module
    assert any("auxiliary-loss-free" in note for note in result.notes)
    assert "ROUTE_NORM = True" in module and "route_norm=ROUTE_NORM" in module
    unnormalised = dataclasses.replace(problem, model=dataclasses.replace(problem.model, norm_topk_prob=False))
    assert "ROUTE_NORM = False" in _export(plan, "torchtitan", unnormalised).files["planner_plan.py"]
    # Expert TP: torchtitan's experts are whole (reset to 1, said); EP folds over dp_shard x cp x tp, not
    # across HSDP replicas (the closest plan it accepts is named).
    etp = _export(plan.replace(tp=2, dp=8, ep=4, etp=2, sequence_parallel=True, param_shard=8, grad_shard=8,
                               optim_shard=8, num_micro_batches=8), "torchtitan", problem)
    assert etp.expressed.etp == 1 and any(line.startswith("etp=2") for line in etp.cannot_express)
    with pytest.raises(Refused, match="ep 8 does not divide"):
        _export(plan.replace(param_shard=4, grad_shard=4, optim_shard=4), "torchtitan", problem)
    deepseek = make_problem(model="deepseek-v3", hardware="h100", gpus=16, gpus_per_node=8, global_batch=64,
                            seq_len=4096)
    with pytest.raises(Refused, match="multi-head latent attention"):
        _export(Plan(dp=16, ep=8, micro_batch=1, num_micro_batches=4), "torchtitan", deepseek)


@pytest.mark.parametrize("name,changes", [("mixtral-8x7b", {}), ("qwen3-30b-a3b", {}), ("qwen3-30b-a3b", {"num_dense_layers": 2}),
                                          ("qwen3-30b-a3b", {"norm_topk_prob": False}),
                                          ("tiny-moe", {"shared_expert_gate": True, "qkv_bias": True}),
                                          ("tiny-moe", {"shared_expert_gate": True, "qkv_bias": True,
                                                        "norm_topk_prob": False})])
def test_deepspeed_moe_config_json_is_the_model_in_transformers_and_in_the_planner(name, changes, tmp_path):
    # DeepSpeed trains the HF model its config.json describes: transformers builds it (meta device) with the
    # planner's parameter count, and the planner reads it back as the same model.
    import torch
    import transformers

    from specs.model import model_from_hf_config

    model = dataclasses.replace(PRESETS_MODELS[name], **changes)
    problem = make_problem(model="tiny", hardware="h100", gpus=8, gpus_per_node=8, global_batch=16, seq_len=64)
    problem = dataclasses.replace(problem, model=model)
    result = _export(Plan(dp=8, ep=2, micro_batch=1, num_micro_batches=2, param_shard=8, grad_shard=8, optim_shard=8),
                     "deepspeed", problem)
    assert result.expressed.ep == 1 and any(line.startswith("ep=2") for line in result.cannot_express)
    config = json.loads(result.files["config.json"])
    path = tmp_path / "config.json"
    path.write_text(result.files["config.json"])
    assert dataclasses.replace(model_from_hf_config(path), name=model.name) == model
    hf = transformers.AutoConfig.for_model(**config)
    with torch.device("meta"):
        built = transformers.AutoModelForCausalLM.from_config(hf)
    assert sum(p.numel() for p in built.parameters()) == model.num_params()


def test_deepspeed_refuses_moe_models_no_hf_architecture_describes():
    for name, changes, why in (("deepseek-v3", {}, "multi-head latent attention"),
                               ("mixtral-8x7b", {"capacity_factor": 1.0}, "capacity factor"),
                               ("tiny-moe", {}, "no HF architecture"),
                               # Mixtral always renormalises its top-k weights
                               ("mixtral-8x7b", {"norm_topk_prob": False}, "no HF architecture")):
        problem = make_problem(model="tiny", hardware="h100", gpus=8, gpus_per_node=8, global_batch=16, seq_len=64)
        problem = dataclasses.replace(problem, model=dataclasses.replace(PRESETS_MODELS[name], **changes))
        with pytest.raises(Refused, match=why):
            _export(Plan(dp=8, micro_batch=1, num_micro_batches=2), "deepspeed", problem)


def test_megatron_moe_flags_are_the_models_and_the_plans():
    case = next(c for c in CASES if c.name == "deepseek-v3-ep64-pp16")
    args = _export(case.build_plan(), "megatron", case.problem()).settings["args"]
    assert (args["--num-experts"], args["--moe-router-topk"], args["--moe-ffn-hidden-size"]) == (256, 8, 2048)
    assert args["--moe-layer-freq"] == "([0]*3+[1]*58)" and args["--moe-shared-expert-intermediate-size"] == 2048
    assert args["--multi-latent-attention"] and (args["--q-lora-rank"], args["--kv-lora-rank"]) == (1536, 512)
    assert (args["--qk-head-dim"], args["--qk-pos-emb-head-dim"], args["--v-head-dim"]) == (128, 64, 128)
    assert (args["--expert-model-parallel-size"], args["--expert-tensor-parallel-size"]) == (64, 1)
    assert args["--moe-router-load-balancing-type"] == "seq_aux_loss" and args["--moe-token-dispatcher-type"] == "alltoall"
    qwen = next(c for c in CASES if c.name == "qwen3-30b-a3b-ep8")
    qargs = _export(qwen.build_plan(), "megatron", qwen.problem()).settings["args"]
    assert qargs["--qk-layernorm"] and qargs["--kv-channels"] == 128 and "--moe-layer-freq" not in qargs
    # The top-k weights: renormalised is Megatron's default (softmax of the chosen logits); not renormalised is
    # its pre-softmax routing, which it requires for top-1 (a renormalised single weight is always 1).
    assert "--moe-router-pre-softmax" not in qargs
    problem = qwen.problem()
    for changes in ({"norm_topk_prob": False}, {"norm_topk_prob": False, "num_experts_per_token": 1}):
        changed = dataclasses.replace(problem, model=dataclasses.replace(problem.model, **changes))
        assert _export(qwen.build_plan(), "megatron", changed).settings["args"]["--moe-router-pre-softmax"] is True
    top1 = dataclasses.replace(problem, model=dataclasses.replace(problem.model, num_experts_per_token=1))
    with pytest.raises(PlannerError, match="Please use --moe-router-pre-softmax when topk is 1"):
        _export(qwen.build_plan(), "megatron", top1)

