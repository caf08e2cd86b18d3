"""MoE model specs: parameter counts against the published totals, HF config.json parsing, one-line errors."""

import json

import pytest

from specs.errors import PlannerError
from specs.model import PRESETS, ModelSpec, model_from_hf_config, resolve_model

# (total, active) parameters as published: Mistral's Mixtral announcements, the Qwen3 technical report,
# the DeepSeek-V3 technical report (671B without the multi-token-prediction module).
PUBLISHED = {
    "mixtral-8x7b": (46.7e9, 12.9e9),
    "mixtral-8x22b": (141e9, 39e9),
    "qwen3-30b-a3b": (30.5e9, 3.3e9),
    "qwen3-235b-a22b": (235e9, 22e9),
    "deepseek-v3": (671e9, 37e9),
}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_preset_parameter_counts_match_published_totals(name):
    total, active = PUBLISHED[name]
    spec = PRESETS[name]
    # The published figures are rounded to the digits shown: total within half a unit of the last digit
    # (141B: 140.6B), active within 2% (DeepSeek's "37B" is 37.55B with the embeddings).
    assert spec.num_params() == pytest.approx(total, rel=0.005)
    assert spec.num_active_params() == pytest.approx(active, rel=0.02)


def test_mixtral_8x7b_count_is_exact():
    # HF's safetensors index of mistralai/Mixtral-8x7B-v0.1 holds 46,702,792,704 parameters.
    assert PRESETS["mixtral-8x7b"].num_params() == 46_702_792_704


def test_moe_layer_hand_count():
    spec = PRESETS["tiny-moe"]
    h = 64
    router, experts, shared = h * 8, 8 * 3 * h * 32, 3 * h * 32
    assert spec.moe_mlp_params() == router + experts + shared
    assert spec.layer_params(0) == spec.attention_params() + 3 * h * 128 + 2 * h  # the leading dense layer
    assert spec.layer_params(1) == spec.attention_params() + router + experts + shared + 2 * h
    assert spec.num_expert_params() == 3 * experts
    assert spec.num_active_params() == spec.num_params() - 3 * 6 * 3 * h * 32


def test_dense_models_unchanged():
    spec = PRESETS["llama3-8b"]
    assert not spec.is_moe and spec.num_params() == 8_030_261_248 == spec.num_active_params()


def test_tiny_moe_divides_every_degree_up_to_4():
    spec = PRESETS["tiny-moe"]
    for degree in (1, 2, 4):
        assert spec.num_experts % degree == 0 and spec.num_heads % degree == 0 and spec.num_kv_heads % degree == 0
        assert spec.num_layers % degree == 0


def _write(tmp_path, cfg):
    path = tmp_path / "m" / "config.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(cfg))
    return path


MIXTRAL = {"model_type": "mixtral", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
           "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 32000, "max_position_embeddings": 32768,
           "num_local_experts": 8, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.02, "tie_word_embeddings": False,
           "rope_theta": 1e6}
QWEN3 = {"model_type": "qwen3_moe", "hidden_size": 2048, "num_hidden_layers": 48, "num_attention_heads": 32,
         "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 6144, "moe_intermediate_size": 768,
         "vocab_size": 151936, "max_position_embeddings": 40960, "num_experts": 128, "num_experts_per_tok": 8,
         "decoder_sparse_step": 1, "mlp_only_layers": [], "router_aux_loss_coef": 0.001, "tie_word_embeddings": False,
         "rope_theta": 1e6, "norm_topk_prob": True}
# Qwen/Qwen1.5-MoE-A2.7B: 14.3B total, 2.7B active (its model card); its config says norm_topk_prob false.
QWEN2 = {"model_type": "qwen2_moe", "hidden_size": 2048, "num_hidden_layers": 24, "num_attention_heads": 16,
         "num_key_value_heads": 16, "intermediate_size": 5632, "moe_intermediate_size": 1408,
         "shared_expert_intermediate_size": 5632, "vocab_size": 151936, "max_position_embeddings": 8192,
         "num_experts": 60, "num_experts_per_tok": 4, "decoder_sparse_step": 1, "tie_word_embeddings": False,
         "norm_topk_prob": False}
DEEPSEEK = {"model_type": "deepseek_v3", "hidden_size": 7168, "num_hidden_layers": 61, "num_attention_heads": 128,
            "num_key_value_heads": 128, "intermediate_size": 18432, "moe_intermediate_size": 2048, "vocab_size": 129280,
            "max_position_embeddings": 163840, "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
            "first_k_dense_replace": 3, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64, "v_head_dim": 128, "aux_loss_alpha": 0.001, "tie_word_embeddings": False,
            "rope_theta": 10000}


@pytest.mark.parametrize("cfg,preset", [(MIXTRAL, "mixtral-8x7b"), (QWEN3, "qwen3-30b-a3b"), (DEEPSEEK, "deepseek-v3")])
def test_hf_config_parses_to_the_preset(tmp_path, cfg, preset):
    spec = resolve_model(str(_write(tmp_path, cfg)))
    assert spec.num_params() == PRESETS[preset].num_params()
    assert spec.num_active_params() == PRESETS[preset].num_active_params()
    assert spec.rope_theta == PRESETS[preset].rope_theta  # the config's rope_theta, the preset's too
    assert spec.norm_topk_prob == PRESETS[preset].norm_topk_prob
    assert spec.norm_eps == PRESETS[preset].norm_eps  # transformers' default where the config is silent


def test_qwen2_moe_config(tmp_path):
    spec = model_from_hf_config(_write(tmp_path, QWEN2))
    assert spec.shared_expert_gate and spec.qkv_bias
    assert not spec.norm_topk_prob  # the chosen experts' probabilities as they are
    assert spec.num_params() == pytest.approx(14.3e9, rel=0.005)
    assert spec.num_active_params() == pytest.approx(2.7e9, rel=0.02)


def test_norm_eps_is_the_configs_with_transformers_default(tmp_path):
    """rms_norm_eps: as written, else transformers' default (Mixtral's 1e-5, Qwen's and DeepSeek's 1e-6)."""
    assert model_from_hf_config(_write(tmp_path, dict(QWEN3, rms_norm_eps=1e-6))).norm_eps == 1e-6
    assert model_from_hf_config(_write(tmp_path, dict(MIXTRAL, rms_norm_eps=1e-6))).norm_eps == 1e-6
    assert model_from_hf_config(_write(tmp_path, MIXTRAL)).norm_eps == 1e-5
    with pytest.raises(PlannerError, match="norm_eps must be between 0 and 1, got 0.0"):
        model_from_hf_config(_write(tmp_path, dict(QWEN2, rms_norm_eps=0)))


def test_norm_topk_prob_is_read_with_transformers_default(tmp_path):
    """Qwen-MoE configs say whether the top-k weights are renormalised; transformers' default is false."""
    unsaid = {k: v for k, v in QWEN3.items() if k != "norm_topk_prob"}
    assert not model_from_hf_config(_write(tmp_path, unsaid)).norm_topk_prob
    assert model_from_hf_config(_write(tmp_path, dict(QWEN2, norm_topk_prob=True))).norm_topk_prob
    with pytest.raises(PlannerError, match="'norm_topk_prob' must be true or false, got 'yes'") as exc:
        model_from_hf_config(_write(tmp_path, dict(QWEN2, norm_topk_prob="yes")))
    assert "\n" not in str(exc.value)


@pytest.mark.parametrize("cfg,key", [(MIXTRAL, "num_local_experts"), (QWEN3, "moe_intermediate_size"),
                                     (DEEPSEEK, "kv_lora_rank"), (QWEN2, "shared_expert_intermediate_size")])
def test_missing_moe_key_is_one_line(tmp_path, cfg, key):
    bad = {k: v for k, v in cfg.items() if k != key}
    with pytest.raises(PlannerError, match=f"missing key '{key}'") as exc:
        model_from_hf_config(_write(tmp_path, bad))
    assert "\n" not in str(exc.value)


def test_bad_moe_values_are_one_line(tmp_path):
    with pytest.raises(PlannerError, match="'num_experts_per_tok' must be an integer"):
        model_from_hf_config(_write(tmp_path, dict(MIXTRAL, num_experts_per_tok="2")))
    with pytest.raises(PlannerError, match="num_experts_per_token must be between 1 and num_experts 8, got 9"):
        model_from_hf_config(_write(tmp_path, dict(MIXTRAL, num_experts_per_tok=9)))
    with pytest.raises(PlannerError, match="'sliding_window' 4096 is not supported"):
        model_from_hf_config(_write(tmp_path, dict(MIXTRAL, sliding_window=4096)))
    with pytest.raises(PlannerError, match="'decoder_sparse_step' 2 is not supported"):
        model_from_hf_config(_write(tmp_path, dict(QWEN3, decoder_sparse_step=2)))
    with pytest.raises(PlannerError, match=r"'mlp_only_layers' \[0, 2\] is not supported"):
        model_from_hf_config(_write(tmp_path, dict(QWEN3, mlp_only_layers=[0, 2])))
    assert model_from_hf_config(_write(tmp_path, dict(QWEN3, mlp_only_layers=[0, 1]))).num_dense_layers == 2


def test_model_json_round_trips_moe_fields():
    spec = PRESETS["deepseek-v3"]
    assert ModelSpec.from_dict(spec.to_dict()) == spec
