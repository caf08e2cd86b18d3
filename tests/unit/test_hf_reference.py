"""Our model code against an outside implementation: Hugging Face transformers' Llama, GPT-2, Qwen2, Qwen3,
Mixtral, Qwen2-MoE and Qwen3-MoE models (a test-only dependency) holding the same weights, on tiny configs
built here (no hub download): logits, loss and the gradient of every parameter agree within 1e-5.

Every other exactness check compares a parallel plan with the one-process run of *our own* model code
(runners/reference.py builds the engine's chunks); this one checks that model code itself: RoPE's
convention and base, GQA's head grouping, RMSNorm / LayerNorm placement and epsilon, SwiGLU's gate and
up projections, GELU, learned positions, tied and untied embeddings, and the loss's token mean; for the
mixtures of experts the router's softmax and top-k, the chosen weights renormalised or not
(norm_topk_prob), each expert's SwiGLU, the shared expert and its sigmoid gate, leading dense layers.

Weights are drawn at random for every tensor (norm weights and biases too, which the engine starts at
1 and 0, so that a norm or bias applied in the wrong place cannot hide behind its initial value).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from specs.model import ModelSpec
from runners.tensor_parallel import TPContext
from runners.transformer import LMHead, build_chunk

transformers = pytest.importorskip("transformers")

BATCH, SEQ = 3, 12
TOL = 1e-5
LLAMA = ModelSpec(name="tiny-llama-gqa", arch="llama", num_layers=2, hidden_size=64, num_heads=8, num_kv_heads=2,
                  ffn_hidden_size=96, vocab_size=128, max_seq_len=32, tied_embeddings=False)
GPT2 = ModelSpec(name="tiny-gpt2", arch="gpt2", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=4,
                 ffn_hidden_size=256, vocab_size=128, max_seq_len=32, tied_embeddings=False)
# Qwen2: q/k/v biases; Qwen3: head_dim 16 on hidden 64 (a query width of 128) and per-head query/key RMSNorms;
# each with a RoPE base other than Llama 3's (Qwen's 1e6, and 100, far enough to fail if the engine ignored it).
# Both with Qwen's norm epsilon, 1e-6 (the others 1e-5), which moves these logits by ~1e-3 if ignored.
QWEN2 = dataclasses.replace(LLAMA, name="tiny-qwen2", qkv_bias=True, rope_base=100.0, norm_eps=1e-6)
QWEN3 = dataclasses.replace(LLAMA, name="tiny-qwen3", attention_head_dim=16, qk_norm=True, rope_base=1e6, norm_eps=1e-6)
# Mixtures of experts (no auxiliary loss: HF's is another formula, and off by default): Mixtral (top-k
# renormalised), Qwen2-MoE (a sigmoid-gated shared expert, a leading dense layer, norm_topk_prob false: the
# chosen experts' softmax probabilities as they are) and Qwen3-MoE (norm_topk_prob true).
MOE = dict(num_experts=4, num_experts_per_token=2, expert_ffn_hidden_size=32)
MIXTRAL = dataclasses.replace(LLAMA, name="tiny-mixtral", rope_base=1e6, **MOE)
QWEN2_MOE = dataclasses.replace(QWEN2, name="tiny-qwen2-moe", shared_expert_ffn_hidden_size=24, shared_expert_gate=True,
                                num_dense_layers=1, norm_topk_prob=False, **MOE)
QWEN3_MOE = dataclasses.replace(QWEN3, name="tiny-qwen3-moe", **MOE)
# Llama 3.1's RoPE scaling (factor 8, low 1, high 4, original 8192): on head_dim 8 at base 500000 one frequency
# is divided by 8 and one mixed, which moves these logits by ~1e-4 if the engine ran unscaled RoPE.
LLAMA31 = dataclasses.replace(LLAMA, name="tiny-llama3.1", rope_scaling="llama3", rope_scaling_factor=8.0,
                              rope_low_freq_factor=1.0, rope_high_freq_factor=4.0, rope_original_max_positions=8192)
SPECS = {"llama-gqa-untied": LLAMA, "llama-gqa-tied": dataclasses.replace(LLAMA, tied_embeddings=True),
         "llama3.1-rope-scaling": LLAMA31,
         "gpt2-untied": GPT2, "gpt2-tied": dataclasses.replace(GPT2, tied_embeddings=True),
         # GPT-2's own GELU, the tanh approximation (HF's gelu_new): ~1e-3 from the exact one
         "gpt2-gelu-tanh": dataclasses.replace(GPT2, gelu_approximation="tanh", norm_eps=1e-6),
         "qwen2-untied": QWEN2, "qwen3-untied": QWEN3, "mixtral": MIXTRAL, "qwen2-moe": QWEN2_MOE,
         "qwen3-moe": QWEN3_MOE}


# --- the weight mapping: our canonical names <-> the HF model's state dict ----------------------------
def _llama_names(spec: ModelSpec) -> dict[str, str]:
    names = {"embed.weight": "model.embed_tokens.weight", "final_norm.weight": "model.norm.weight",
             "lm_head.weight": "lm_head.weight"}
    ours_to_hf = {"norm1.weight": "input_layernorm.weight", "norm2.weight": "post_attention_layernorm.weight",
                  "attn.wq": "self_attn.q_proj.weight", "attn.wk": "self_attn.k_proj.weight",
                  "attn.wv": "self_attn.v_proj.weight", "attn.wo": "self_attn.o_proj.weight",
                  "mlp.w_gate": "mlp.gate_proj.weight", "mlp.w_in": "mlp.up_proj.weight",
                  "mlp.w_out": "mlp.down_proj.weight"}
    if spec.qkv_bias:
        ours_to_hf.update({"attn.bq": "self_attn.q_proj.bias", "attn.bk": "self_attn.k_proj.bias",
                           "attn.bv": "self_attn.v_proj.bias"})
    if spec.qk_norm:
        ours_to_hf.update({"attn.q_norm.weight": "self_attn.q_norm.weight", "attn.k_norm.weight": "self_attn.k_norm.weight"})
    moe = {"mlp.router": "mlp.gate.weight", "mlp.experts.w_out": "mlp.experts.down_proj",
           "mlp.shared.w_gate": "mlp.shared_expert.gate_proj.weight",
           "mlp.shared.w_in": "mlp.shared_expert.up_proj.weight",
           "mlp.shared.w_out": "mlp.shared_expert.down_proj.weight", "mlp.shared_gate": "mlp.shared_expert_gate.weight"}
    for i in range(spec.num_layers):
        dense = {k: v for k, v in ours_to_hf.items() if not k.startswith("mlp.")}
        layer = ours_to_hf if i < spec.num_dense_layers or not spec.is_moe else dict(dense, **moe)
        names.update({f"layers.{i}.{k}": f"model.layers.{i}.{v}" for k, v in layer.items()})
    return names


def _fused_experts(spec: ModelSpec) -> dict[str, tuple[str, str]]:
    """HF (transformers 5) stores each MoE layer's gate and up projections as one [E, 2F, h] tensor, gate
    rows first: its name and our two halves."""
    return {f"model.layers.{i}.mlp.experts.gate_up_proj": (f"layers.{i}.mlp.experts.w_gate",
                                                             f"layers.{i}.mlp.experts.w_in")
            for i in range(spec.num_dense_layers, spec.num_layers)} if spec.is_moe else {}


def to_hf(spec: ModelSpec, ours: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our tensors (canonical names) as the HF model's state dict entries."""
    if spec.arch == "llama":
        out = {hf: ours[name] for name, hf in _llama_names(spec).items() if name in ours}
        out.update({hf: torch.cat([ours[gate], ours[up]], dim=1) for hf, (gate, up) in _fused_experts(spec).items()})
        return out
    out = {"transformer.wte.weight": ours["embed.weight"], "transformer.wpe.weight": ours["embed.pos"],
           "transformer.ln_f.weight": ours["final_norm.weight"], "transformer.ln_f.bias": ours["final_norm.bias"],
           "lm_head.weight": ours.get("lm_head.weight", ours["embed.weight"])}
    for i in range(spec.num_layers):
        o, h = (lambda k: ours[f"layers.{i}.{k}"]), f"transformer.h.{i}"
        # GPT-2's Conv1D stores weights as [in, out]: ours transposed; q, k and v fused in one matrix.
        out.update({
            f"{h}.ln_1.weight": o("norm1.weight"), f"{h}.ln_1.bias": o("norm1.bias"),
            f"{h}.ln_2.weight": o("norm2.weight"), f"{h}.ln_2.bias": o("norm2.bias"),
            f"{h}.attn.c_attn.weight": torch.cat([o("attn.wq"), o("attn.wk"), o("attn.wv")]).t(),
            f"{h}.attn.c_attn.bias": torch.cat([o("attn.bq"), o("attn.bk"), o("attn.bv")]),
            f"{h}.attn.c_proj.weight": o("attn.wo").t(), f"{h}.attn.c_proj.bias": o("attn.bo"),
            f"{h}.mlp.c_fc.weight": o("mlp.w_in").t(), f"{h}.mlp.c_fc.bias": o("mlp.b_in"),
            f"{h}.mlp.c_proj.weight": o("mlp.w_out").t(), f"{h}.mlp.c_proj.bias": o("mlp.b_out")})
    return out


def from_hf(spec: ModelSpec, hf: dict[str, torch.Tensor], names: list[str]) -> dict[str, torch.Tensor]:
    """HF tensors (parameters or gradients) under our canonical `names`: to_hf's inverse."""
    if spec.arch == "llama":
        mapping = _llama_names(spec)
        out = {name: hf[mapping[name]] for name in names if name in mapping}
        for fused, (gate, up) in _fused_experts(spec).items():
            out[gate], out[up] = hf[fused].chunk(2, dim=1)
        assert set(out) == set(names), set(out) ^ set(names)
        return out
    h = spec.hidden_size
    out = {"embed.weight": hf["transformer.wte.weight"], "embed.pos": hf["transformer.wpe.weight"],
           "final_norm.weight": hf["transformer.ln_f.weight"], "final_norm.bias": hf["transformer.ln_f.bias"]}
    if "lm_head.weight" in names:
        out["lm_head.weight"] = hf["lm_head.weight"]
    for i in range(spec.num_layers):
        p = f"transformer.h.{i}"
        qkv_w, qkv_b = hf[f"{p}.attn.c_attn.weight"].t(), hf[f"{p}.attn.c_attn.bias"]
        layer = {"norm1.weight": hf[f"{p}.ln_1.weight"], "norm1.bias": hf[f"{p}.ln_1.bias"],
                 "norm2.weight": hf[f"{p}.ln_2.weight"], "norm2.bias": hf[f"{p}.ln_2.bias"],
                 "attn.wq": qkv_w[:h], "attn.wk": qkv_w[h:2 * h], "attn.wv": qkv_w[2 * h:],
                 "attn.bq": qkv_b[:h], "attn.bk": qkv_b[h:2 * h], "attn.bv": qkv_b[2 * h:],
                 "attn.wo": hf[f"{p}.attn.c_proj.weight"].t(), "attn.bo": hf[f"{p}.attn.c_proj.bias"],
                 "mlp.w_in": hf[f"{p}.mlp.c_fc.weight"].t(), "mlp.b_in": hf[f"{p}.mlp.c_fc.bias"],
                 "mlp.w_out": hf[f"{p}.mlp.c_proj.weight"].t(), "mlp.b_out": hf[f"{p}.mlp.c_proj.bias"]}
        out.update({f"layers.{i}.{k}": v for k, v in layer.items()})
    assert set(out) == set(names), set(out) ^ set(names)
    return out


def hf_model(spec: ModelSpec):
    """The HF model of `spec`'s architecture and shape (Qwen2 / Qwen3 for their attention variants): its norm
    epsilon (norm_eps), RoPE base (rope_base), its GELU (exact or tanh), no dropout, embeddings tied or not as
    `spec`."""
    if spec.is_moe:
        return _hf_moe_model(spec).float().train()
    if spec.qk_norm or spec.qkv_bias:
        common = dict(vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, intermediate_size=spec.ffn_hidden_size,
                      num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads,
                      num_key_value_heads=spec.num_kv_heads, max_position_embeddings=spec.max_seq_len,
                      rms_norm_eps=spec.norm_eps, rope_theta=spec.rope_theta, tie_word_embeddings=spec.tied_embeddings,
                      use_sliding_window=False, attention_dropout=0.0)
        if spec.qk_norm:
            model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common, head_dim=spec.head_dim,
                                                                          attention_bias=False))
        else:
            model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    elif spec.arch == "llama":
        config = transformers.LlamaConfig(
            vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, intermediate_size=spec.ffn_hidden_size,
            num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads,
            num_key_value_heads=spec.num_kv_heads, max_position_embeddings=spec.max_seq_len, rms_norm_eps=spec.norm_eps,
            rope_theta=spec.rope_theta, tie_word_embeddings=spec.tied_embeddings, attention_bias=False, mlp_bias=False,
            rope_scaling=None if spec.rope_scaling == "none" else {
                "rope_type": "llama3", "factor": spec.rope_scaling_factor, "low_freq_factor": spec.rope_low_freq_factor,
                "high_freq_factor": spec.rope_high_freq_factor,
                "original_max_position_embeddings": spec.rope_original_max_positions})
        model = transformers.LlamaForCausalLM(config)
    else:
        config = transformers.GPT2Config(
            vocab_size=spec.vocab_size, n_embd=spec.hidden_size, n_layer=spec.num_layers, n_head=spec.num_heads,
            n_inner=spec.ffn_hidden_size, n_positions=spec.max_seq_len,
            activation_function={"none": "gelu", "tanh": "gelu_new"}[spec.gelu_approximation],
            layer_norm_epsilon=spec.norm_eps, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
            tie_word_embeddings=spec.tied_embeddings, bos_token_id=None, eos_token_id=None)
        model = transformers.GPT2LMHeadModel(config)
    return model.float().train()


def _hf_moe_model(spec: ModelSpec):
    """Mixtral, Qwen2-MoE or Qwen3-MoE of `spec`'s shape, the architecture its attention names."""
    common = dict(vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, num_hidden_layers=spec.num_layers,
                  num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
                  max_position_embeddings=spec.max_seq_len, rms_norm_eps=spec.norm_eps, rope_theta=spec.rope_theta,
                  tie_word_embeddings=spec.tied_embeddings, attention_dropout=0.0,
                  num_experts_per_tok=spec.num_experts_per_token, output_router_logits=False)
    if not (spec.qk_norm or spec.qkv_bias):
        return transformers.MixtralForCausalLM(transformers.MixtralConfig(
            **common, num_local_experts=spec.num_experts, intermediate_size=spec.expert_ffn_hidden_size,
            sliding_window=None, router_jitter_noise=0.0))
    qwen = dict(common, num_experts=spec.num_experts, moe_intermediate_size=spec.expert_ffn_hidden_size,
                intermediate_size=spec.ffn_hidden_size, norm_topk_prob=spec.norm_topk_prob, decoder_sparse_step=1,
                mlp_only_layers=list(range(spec.num_dense_layers)), use_sliding_window=False)
    if spec.qk_norm:
        return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**qwen, head_dim=spec.head_dim,
                                                                            attention_bias=False))
    return transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
        **qwen, shared_expert_intermediate_size=spec.shared_expert_ffn_hidden_size))


# --- the comparison ---------------------------------------------------------------------------------------
def _ours(spec: ModelSpec, *, seed: int):
    """Our one-process model (the reference's build) with every tensor redrawn at random."""
    chunk = build_chunk(spec, layers=range(spec.num_layers), first=True, last=True, seed=seed, tp=TPContext.single(),
                        recompute="none", loss_scale=1.0 / (BATCH * SEQ), share_tied=True)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in chunk.parameters():
            noise = torch.randn(p.shape, generator=gen)
            if p.dim() >= 2:  # matrices, and the experts' stacked ones
                p.copy_(noise * 0.05)
            else:  # norm weights around 1, biases around 0
                is_norm_weight = "norm" in p.canonical_name and p.canonical_name.endswith(".weight")
                p.copy_(noise * 0.1 + (1.0 if is_norm_weight else 0.0))
    return chunk


def _our_logits(chunk, tokens: torch.Tensor) -> torch.Tensor:
    x = tokens
    for unit in chunk.units:
        x = torch.nn.functional.linear(x, unit.weight) if isinstance(unit, LMHead) else unit(x)
    return x.transpose(0, 1)  # [s, b, V] -> [b, s, V]


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("name", list(SPECS))
def test_model_matches_hugging_face(name):
    spec = SPECS[name]
    chunk = _ours(spec, seed=11)
    params = {p.canonical_name: p for p in chunk.parameters()}  # tied: one Parameter, one name
    model = hf_model(spec)
    state = to_hf(spec, {k: v.detach() for k, v in params.items()})
    missing, unexpected = model.load_state_dict(state, strict=False)
    # Only buffers (RoPE frequencies) and a tied head (the embedding itself) may be left to HF.
    allowed = {"lm_head.weight"} if spec.tied_embeddings else set()
    assert not unexpected and all(k in allowed or "rotary" in k for k in missing), (missing, unexpected)
    assert (model.lm_head.weight is model.get_input_embeddings().weight) == spec.tied_embeddings

    sequences = torch.randint(spec.vocab_size, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(5))
    out = model(input_ids=sequences, labels=sequences)  # HF shifts the labels itself: mean over B x SEQ
    loss = chunk(sequences[:, :-1], sequences[:, 1:])
    loss.backward()
    out.loss.backward()
    with torch.no_grad():
        logits = _our_logits(chunk, sequences[:, :-1])
    assert _relative_error(logits, out.logits[:, :SEQ]) <= TOL
    assert abs(loss.item() - out.loss.item()) <= TOL * abs(out.loss.item())
    hf_grads = from_hf(spec, {k: p.grad for k, p in model.named_parameters()}, list(params))
    scale = max(g.abs().max().item() for g in hf_grads.values())
    for key, p in params.items():
        if key.endswith("attn.bk") and spec.learned_positions:
            # Zero in exact arithmetic without RoPE: the key bias adds q.b_k to every score of a query, which
            # softmax ignores. Both sides must hold rounding noise only. (Under RoPE each position rotates the
            # bias differently: Qwen2's key bias has a real gradient.)
            assert max(p.grad.abs().max().item(), hf_grads[key].abs().max().item()) <= TOL * scale, key
            continue
        assert p.grad is not None and p.grad.abs().max() > 0, key
        err = _relative_error(p.grad, hf_grads[key])
        assert err <= TOL, f"{name}: gradient of {key} differs from HF's by {err:.1e} of its largest element"


@pytest.mark.parametrize("name", ["llama-gqa-untied", "gpt2-untied", "qwen3-untied"])
def test_the_mapping_is_checked(name):
    """The comparison is not vacuous: the same weights with two layers' MLP inputs swapped, or one
    norm weight perturbed by 1%, give other logits."""
    spec = SPECS[name]
    chunk = _ours(spec, seed=11)
    tensors = {p.canonical_name: p.detach().clone() for p in chunk.parameters()}
    assert all(torch.equal(tensors[k], v) for k, v in from_hf(spec, to_hf(spec, tensors), list(tensors)).items())
    sequences = torch.randint(spec.vocab_size, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ours = _our_logits(chunk, sequences[:, :-1])
    for change in ("swap", "norm"):
        wrong = dict(tensors)
        if change == "swap":
            wrong["layers.0.mlp.w_in"], wrong["layers.1.mlp.w_in"] = tensors["layers.1.mlp.w_in"], tensors["layers.0.mlp.w_in"]
        else:
            wrong["layers.1.norm2.weight"] = tensors["layers.1.norm2.weight"] * 1.01
        model = hf_model(spec)
        model.load_state_dict(to_hf(spec, wrong), strict=False)
        with torch.no_grad():
            assert _relative_error(ours, model(input_ids=sequences).logits[:, :SEQ]) > 100 * TOL, change
