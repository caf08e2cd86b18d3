"""The four input types: validation, exact-key JSON round trips, presets and HF configs."""

import json

import pytest

from specs.errors import PlannerError
from specs.problem import make_problem
from planner.inputs import plan_from_options
from specs.job import Job
from specs.model import PRESETS, ModelSpec, resolve_model
from specs.plan import Plan, check_plan, zero_degrees
from specs.hardware import PRESETS as HW, Hardware, resolve_hardware


def test_preset_parameter_counts_match_published_sizes():
    # Published sizes: Llama 3 8B = 8.03B, 70B = 70.6B, 405B = 405.9B; Megatron's 1.7B ... 1T rows.
    assert PRESETS["llama3-8b"].num_params() == 8_030_261_248
    assert abs(PRESETS["llama3-70b"].num_params() / 1e9 - 70.55) < 0.01
    assert abs(PRESETS["llama3-405b"].num_params() / 1e9 - 405.85) < 0.01
    assert abs(PRESETS["gpt3-175b"].num_params() / 1e9 - 174.6) < 0.1
    assert abs(PRESETS["gpt3-1t"].num_params() / 1e9 - 1008.0) < 0.1


def test_hand_counted_llama_layer():
    spec = ModelSpec(name="m", arch="llama", num_layers=2, hidden_size=8, num_heads=4, num_kv_heads=2,
                     ffn_hidden_size=16, vocab_size=10, max_seq_len=4, tied_embeddings=False)
    # q, o: 8x8 each; k, v: 8x4 each; MLP 3 x 8x16; two RMSNorms of 8.
    assert spec.layer_params() == 64 + 64 + 32 + 32 + 384 + 16
    assert spec.num_params() == 10 * 8 + 2 * spec.layer_params() + 8 + 10 * 8


def test_zero_points_and_nesting():
    assert zero_degrees(1, 8) == (1, 1, 8)
    assert Plan(dp=8, param_shard=8, grad_shard=8, optim_shard=8).zero_level == 3
    assert Plan(dp=4, param_shard=2, grad_shard=2, optim_shard=4).zero_level is None
    with pytest.raises(ValueError, match="nest"):
        Plan(dp=4, param_shard=4, grad_shard=2, optim_shard=4)
    with pytest.raises(ValueError, match="does not divide dp"):
        Plan(dp=4, optim_shard=3)


def test_plan_json_round_trip_and_exact_keys():
    plan = Plan(dp=2, pp=2, virtual_stages=2, schedule="interleaved-1f1b", num_micro_batches=4,
                stage_layers=(1, 3, 2, 2), param_shard=2, grad_shard=2, optim_shard=2,
                param_cache=("device", "none", "host", "none", "none", "none", "none", "none"))
    assert Plan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan
    with pytest.raises(PlannerError, match="unknown key 'db'"):
        Plan.from_dict({"db": 2})
    with pytest.raises(PlannerError, match="plan.tp: expected an integer"):
        Plan.from_dict({"tp": "2"})


def test_even_split_gives_remainder_to_middle_chunks():
    assert Plan(pp=4).chunk_layer_counts(10) == (2, 3, 3, 2)
    assert Plan(pp=2).chunk_layer_counts(5) == (3, 2)


def test_check_plan_names_what_does_not_fit():
    problem = make_problem(model="tiny", hardware="cpu", gpus=4, gpus_per_node=None, global_batch=8, seq_len=32)
    with pytest.raises(PlannerError, match="tp 3 does not divide the model's num_heads 8"):
        check_plan(Plan(tp=3), model=problem.model, num_devices=3, job=Job(global_batch=1, seq_len=8))
    with pytest.raises(PlannerError, match="but the cluster has 4 devices"):
        plan_from_options({"dp": 2, "tp": 1}, problem)
    assert plan_from_options({"zero": 3}, problem).shard_degrees == (4, 4, 4)
    with pytest.raises(PlannerError, match="global batch 8 is not divisible"):
        plan_from_options({"micro_batch": 3}, problem)
    with pytest.raises(PlannerError, match="exceeds the model's 8 layers"):
        check_plan(Plan(pp=16, num_micro_batches=1), model=problem.model, num_devices=16,
                   job=Job(global_batch=1, seq_len=8))


def test_unknown_names_suggest_close_matches(tmp_path):
    with pytest.raises(PlannerError, match="did you mean llama3-8b"):
        resolve_model("llama3-8")
    with pytest.raises(PlannerError, match="did you mean h100"):
        resolve_hardware("h10")
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(PlannerError, match="not valid JSON"):
        resolve_model(str(bad))
    bad.write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    with pytest.raises(PlannerError, match="missing key 'num_attention_heads'"):
        resolve_model(str(bad))


def test_hf_configs(tmp_path):
    llama = {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
             "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
             "max_position_embeddings": 8192, "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(llama))
    spec = resolve_model(str(tmp_path / "config.json"))
    assert spec.num_params() == PRESETS["llama3-8b"].num_params()
    gpt2 = {"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12, "n_inner": None,
            "vocab_size": 50257, "n_positions": 1024}
    (tmp_path / "config.json").write_text(json.dumps(gpt2))
    assert abs(resolve_model(str(tmp_path)).num_params() - 124_439_808) == 0  # GPT-2 small


# Qwen/Qwen3-8B and Qwen/Qwen2.5-7B config.json (the keys the planner reads, as HF writes them).
QWEN3_8B = {"model_type": "qwen3", "hidden_size": 4096, "num_hidden_layers": 36, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 12288, "vocab_size": 151936,
            "max_position_embeddings": 40960, "tie_word_embeddings": False, "attention_bias": False,
            "use_sliding_window": False}
QWEN25_7B = {"model_type": "qwen2", "hidden_size": 3584, "num_hidden_layers": 28, "num_attention_heads": 28,
             "num_key_value_heads": 4, "intermediate_size": 18944, "vocab_size": 152064,
             "max_position_embeddings": 131072, "tie_word_embeddings": False, "use_sliding_window": False}


@pytest.mark.parametrize("cfg,preset,billions", [(QWEN3_8B, "qwen3-8b", 8.19), (QWEN25_7B, "qwen2.5-7b", 7.62)])
def test_dense_qwen_configs(tmp_path, cfg, preset, billions):
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    spec = resolve_model(str(tmp_path))
    assert spec.num_params() == PRESETS[preset].num_params() == pytest.approx(billions * 1e9, rel=0.002)
    assert (spec.qk_norm, spec.qkv_bias, spec.head_dim) == (PRESETS[preset].qk_norm, PRESETS[preset].qkv_bias, 128)


@pytest.mark.parametrize("change,match", [({"use_sliding_window": True}, "'use_sliding_window' true is not supported"),
                                          ({"attention_bias": True}, "'attention_bias' true is not supported")])
def test_qwen_variants_the_engine_does_not_model_are_one_line(tmp_path, change, match):
    (tmp_path / "config.json").write_text(json.dumps(dict(QWEN3_8B, **change)))
    with pytest.raises(PlannerError, match=match) as exc:
        resolve_model(str(tmp_path))
    assert "\n" not in str(exc.value)


def test_hardware_profile_round_trip(tmp_path):
    path = tmp_path / "profile.json"
    HW["h100"].save(path)
    assert resolve_hardware(str(path)) == HW["h100"]
    data = HW["h100"].to_dict()
    del data["memory_bytes"]
    path.write_text(json.dumps(data))
    with pytest.raises(PlannerError, match="missing key 'memory_bytes'"):
        resolve_hardware(str(path))
    assert isinstance(Hardware.from_dict(HW["cpu"].to_dict()), Hardware)


def test_plan_file_round_trips_and_checks_its_keys_exactly(tmp_path):
    from specs.hardware import PRESETS as HARDWARE
    from specs.planfile import HardwareSource, PlanFile, hardware_source, read_plan_json
    from specs.problem import make_problem

    problem = make_problem(model="llama3-8b", hardware="h100", gpus=16, gpus_per_node=8, global_batch=64, seq_len=4096)
    plan = Plan(dp=8, pp=2, micro_batch=1, num_micro_batches=8, optim_shard=8, recompute_layers=("full",) * 32)
    original = PlanFile(plan=plan, model=problem.model, job=problem.job, cluster=problem.cluster,
                        hardware_source=hardware_source("h100"), engine="megatron", estimate={"step_time_s": 1.0})
    path = tmp_path / "plan.json"
    original.save(path)
    assert read_plan_json(path) == original
    data = original.to_dict()
    for key, value, message in (("bogus", 1, "unknown key 'bogus'"), ("engine", "jax", "engine must be one of"),
                                ("format", "planner-plan/0", "is not 'planner-plan/1'"),
                                ("cluster", {"num_devices": 8, "devices_per_node": 8}, "but the cluster has 8")):
        with pytest.raises(PlannerError, match=message):
            PlanFile.from_dict({**data, key: value})
    with pytest.raises(PlannerError, match="missing key 'hardware'"):
        PlanFile.from_dict({k: v for k, v in data.items() if k != "hardware"})
    profile = tmp_path / "profile.json"
    HARDWARE["cpu"].save(profile)
    source = hardware_source(str(profile))
    assert source.sha256 is not None and len(source.sha256) == 64 and HardwareSource("h100").sha256 is None
