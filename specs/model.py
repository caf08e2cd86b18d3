"""What is trained: the transformer's shape, from a preset or an HF-style config.json.

Parameter counts follow the architecture exactly (GQA key/value heads, SwiGLU's three MLP matrices,
biases and LayerNorm for GPT-2, tied or separate embeddings) because every one of them changes the
memory and communication the cost model prices.

Mixtures of experts (num_experts > 0) replace the MLP of every layer after `num_dense_layers` by a router
(hidden -> num_experts logits), `num_experts` SwiGLU experts of width `expert_ffn_hidden_size` of which
each token uses `num_experts_per_token`, and optionally an always-used shared expert of width
`shared_expert_ffn_hidden_size` (Qwen2-MoE gates it with a sigmoid of one more hidden-wide row). DeepSeek-V3's
multi-head latent attention (MLA) is described by its low-rank dims (kv_lora_rank > 0); the cost model
prices it, the engine does not run it.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass
from pathlib import Path

from specs.errors import PlannerError
from specs.jsonio import dataclass_from_dict, dataclass_to_dict, read_json_file

ARCHS = ("llama", "gpt2")
# HF's rope_type values: "default" is "none" here; the engine runs "none" and "llama3".
ROPE_SCALINGS = ("none", "llama3", "linear", "dynamic", "yarn", "longrope")
LOAD_BALANCING = ("aux_loss", "aux_free", "forced")


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer.

    `arch` fixes the block's details: "llama" is RMSNorm, RoPE, SwiGLU MLP, no biases;
    "gpt2" is LayerNorm, learned positions, GELU MLP, biases.
    """

    name: str
    arch: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    ffn_hidden_size: int
    vocab_size: int
    max_seq_len: int
    tied_embeddings: bool
    # --- mixture of experts (num_experts 0: a dense model) -----------------------------------------
    num_experts: int = 0
    num_experts_per_token: int = 0  # top-k
    expert_ffn_hidden_size: int = 0
    shared_expert_ffn_hidden_size: int = 0  # 0: no shared expert
    shared_expert_gate: bool = False  # Qwen2-MoE: sigmoid(x . w) scales the shared expert's output
    num_dense_layers: int = 0  # leading layers with a dense MLP of ffn_hidden_size (DeepSeek's first_k_dense_replace)
    capacity_factor: float = 0.0  # 0: dropless; else each expert takes ceil(cf x tokens x k / E) per sequence
    aux_loss_coeff: float = 0.0  # load-balancing loss coefficient (Switch / Megatron-Core's form)
    # A token's k expert weights: its softmax probabilities over all experts renormalised over the chosen k
    # (Mixtral's softmax of the top-k logits, Qwen3-MoE's norm_topk_prob true) or, False, those
    # probabilities as they are (Qwen1.5/Qwen2-MoE's norm_topk_prob false; Megatron's --moe-router-pre-softmax).
    # Ignored without experts (a dense view of an MoE model keeps it).
    norm_topk_prob: bool = True
    # How the router's load is balanced, which sets the expected load imbalance the cost model prices
    # (cost_models/moe.py, expected_imbalance): "aux_loss" (a balancing loss: Switch, Mixtral, Qwen),
    # "aux_free" (DeepSeek-V3's bias-adjusted top-k, topk_method noaux_tc) or "forced" (Megatron-Core's
    # --moe-router-force-load-balancing, the benchmarks' routing on random logits: no preferred expert,
    # only the sampling spread).
    load_balancing: str = "aux_loss"
    # --- attention variants ------------------------------------------------------------------------
    attention_head_dim: int = 0  # 0: hidden_size / num_heads (Qwen3 sets head_dim 128 with hidden 2048, 32 heads)
    qkv_bias: bool = False  # Qwen2's query/key/value biases on a llama block
    qk_norm: bool = False  # Qwen3's RMSNorm of each query and key head
    # DeepSeek-V3 MLA: queries through a rank-q_lora_rank bottleneck, keys and values through one shared
    # rank-kv_lora_rank latent plus a qk_rope_head_dim RoPE key shared by the heads.
    q_lora_rank: int = 0
    kv_lora_rank: int = 0  # > 0: MLA
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # RoPE base of a llama-arch model (HF's rope_theta; Llama 3's 500000, Qwen's and Mixtral's 1e6).
    rope_base: float = 500000.0
    # Its frequencies' scaling (HF's rope_scaling / rope_parameters rope_type): "none", or "llama3" (Llama
    # 3.1+: wavelengths over original_max_positions / low_freq_factor divided by the factor, under
    # original_max_positions / high_freq_factor kept, a smooth mix between), which the engine and every
    # export run; HF's other types (linear, dynamic, yarn, longrope) are recorded, priced like unscaled RoPE
    # (the same FLOPs), and refused by the engine.
    rope_scaling: str = "none"
    rope_scaling_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_positions: int = 8192
    # The RMSNorm / LayerNorm epsilon (HF's rms_norm_eps, GPT-2's layer_norm_epsilon): Llama's and Mixtral's
    # 1e-5, Qwen's and DeepSeek's 1e-6; the engine and every export use it.
    norm_eps: float = 1e-5
    # A gpt2-arch model's GELU: "none" (exact, erf) or "tanh" (the tanh approximation, HF's gelu_new, GPT-2's).
    gelu_approximation: str = "none"

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise ValueError(f"arch must be one of {', '.join(ARCHS)}, got {self.arch!r}")
        for field in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "ffn_hidden_size",
                      "vocab_size", "max_seq_len"):
            if getattr(self, field) < 1:
                raise ValueError(f"{field} must be at least 1, got {getattr(self, field)}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not divisible by num_kv_heads {self.num_kv_heads}")
        self._check_moe()
        if not self.rope_base > 0:
            raise ValueError(f"rope_base must be positive, got {self.rope_base}")
        self._check_rope_scaling()
        if not 0 < self.norm_eps < 1:
            raise ValueError(f"norm_eps must be between 0 and 1, got {self.norm_eps}")
        if self.gelu_approximation not in ("none", "tanh"):
            raise ValueError(f"gelu_approximation must be none or tanh, got {self.gelu_approximation!r}")
        if self.kv_lora_rank and min(self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim) < 1:
            raise ValueError("MLA (kv_lora_rank > 0) needs qk_nope_head_dim, qk_rope_head_dim and v_head_dim of at least 1")

    def _check_rope_scaling(self) -> None:
        if self.rope_scaling not in ROPE_SCALINGS:
            raise ValueError(f"rope_scaling must be one of {', '.join(ROPE_SCALINGS)}, got {self.rope_scaling!r}")
        valid = (self.rope_scaling_factor >= 1 and self.rope_original_max_positions >= 1
                 and 0 < self.rope_low_freq_factor < self.rope_high_freq_factor)
        if self.rope_scaling == "llama3" and not valid:
            raise ValueError(f"llama3 rope scaling needs factor >= 1, 0 < low_freq_factor < high_freq_factor and "
                             f"original_max_position_embeddings >= 1, got {self.rope_scaling_factor}, "
                             f"{self.rope_low_freq_factor}, {self.rope_high_freq_factor}, "
                             f"{self.rope_original_max_positions}")

    def _check_moe(self) -> None:
        for name in ("num_experts", "num_experts_per_token", "expert_ffn_hidden_size", "shared_expert_ffn_hidden_size",
                     "num_dense_layers", "attention_head_dim", "q_lora_rank", "kv_lora_rank"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be at least 0, got {getattr(self, name)}")
        if self.load_balancing not in LOAD_BALANCING:
            raise ValueError(f"load_balancing must be one of {', '.join(LOAD_BALANCING)}, got {self.load_balancing!r}")
        if self.capacity_factor < 0 or self.aux_loss_coeff < 0:
            raise ValueError(f"capacity_factor and aux_loss_coeff must be at least 0, got {self.capacity_factor} "
                             f"and {self.aux_loss_coeff}")
        if self.num_experts == 0:
            if self.num_experts_per_token or self.expert_ffn_hidden_size or self.shared_expert_ffn_hidden_size:
                raise ValueError("num_experts_per_token, expert_ffn_hidden_size and shared_expert_ffn_hidden_size "
                                 "need num_experts > 0")
            return
        if self.arch != "llama":
            raise ValueError(f"mixture-of-experts layers need arch llama (SwiGLU experts), got {self.arch!r}")
        if not 1 <= self.num_experts_per_token <= self.num_experts:
            raise ValueError(f"num_experts_per_token must be between 1 and num_experts {self.num_experts}, "
                             f"got {self.num_experts_per_token}")
        if self.expert_ffn_hidden_size < 1:
            raise ValueError("a mixture of experts needs expert_ffn_hidden_size of at least 1")
        if self.num_dense_layers >= self.num_layers:
            raise ValueError(f"num_dense_layers {self.num_dense_layers} leaves no MoE layer of {self.num_layers}")
        if self.shared_expert_gate and not self.shared_expert_ffn_hidden_size:
            raise ValueError("shared_expert_gate needs a shared expert (shared_expert_ffn_hidden_size > 0)")

    # --- shape helpers -------------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        """Query/key width of one head: Qwen3's explicit head_dim, MLA's nope + rope dims, else h / heads."""
        if self.attention_head_dim:
            return self.attention_head_dim
        if self.uses_mla:
            return self.qk_nope_head_dim + self.qk_rope_head_dim
        return self.hidden_size // self.num_heads

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def uses_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.num_dense_layers if self.is_moe else 0

    def is_moe_layer(self, layer: int) -> bool:
        """Whether global layer `layer` has an MoE MLP (the leading num_dense_layers stay dense)."""
        return self.is_moe and layer >= self.num_dense_layers

    @property
    def kv_dim(self) -> int:
        """Width of the key (or value) projection: num_kv_heads * head_dim."""
        return self.num_kv_heads * self.head_dim

    @property
    def gated_mlp(self) -> bool:
        return self.arch == "llama"

    @property
    def has_bias(self) -> bool:
        return self.arch == "gpt2"

    @property
    def learned_positions(self) -> bool:
        return self.arch == "gpt2"

    @property
    def rope_theta(self) -> float | None:
        """The RoPE base of a llama model (`rope_base`; its scaling is `rope_scaling`), None for learned
        positions; the engine and every export use it."""
        return self.rope_base if self.arch == "llama" else None

    # --- parameter counts ----------------------------------------------------------------------
    def attention_params(self) -> int:
        if self.uses_mla:
            return self._mla_params()
        h, kv, q = self.hidden_size, self.kv_dim, self.num_heads * self.head_dim
        weights = h * q + 2 * h * kv + q * h
        biases = (q + 2 * kv + h) if self.has_bias else (q + 2 * kv) if self.qkv_bias else 0
        norms = 2 * self.head_dim if self.qk_norm else 0
        return weights + biases + norms

    def _mla_params(self) -> int:
        """DeepSeek-V3's MLA: q_a (h -> q_lora) + norm + q_b (-> heads x (nope + rope)); kv_a (h -> kv_lora +
        rope) + norm + kv_b (-> heads x (nope + v)); o (heads x v -> h). q_lora_rank 0: one q projection."""
        h, n = self.hidden_size, self.num_heads
        qk = self.qk_nope_head_dim + self.qk_rope_head_dim
        q = (h * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * n * qk) if self.q_lora_rank else h * n * qk
        kv = h * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
        kv += self.kv_lora_rank * n * (self.qk_nope_head_dim + self.v_head_dim)
        return q + kv + n * self.v_head_dim * h

    def mlp_params(self) -> int:
        """A dense layer's MLP (width ffn_hidden_size)."""
        h, f = self.hidden_size, self.ffn_hidden_size
        if self.gated_mlp:
            return 3 * h * f
        return 2 * h * f + ((f + h) if self.has_bias else 0)

    def expert_params(self) -> int:
        """One routed expert (SwiGLU of width expert_ffn_hidden_size)."""
        return 3 * self.hidden_size * self.expert_ffn_hidden_size

    def router_params(self) -> int:
        return self.hidden_size * self.num_experts

    def shared_expert_params(self) -> int:
        """The shared expert and its gate (both always used)."""
        gate = self.hidden_size if self.shared_expert_gate else 0
        return 3 * self.hidden_size * self.shared_expert_ffn_hidden_size + gate

    def moe_mlp_params(self) -> int:
        """An MoE layer's MLP: router, every routed expert, the shared expert."""
        return self.router_params() + self.num_experts * self.expert_params() + self.shared_expert_params()

    def layer_mlp_params(self, layer: int) -> int:
        return self.moe_mlp_params() if self.is_moe_layer(layer) else self.mlp_params()

    def norm_params(self) -> int:
        """Parameters of one normalisation layer (RMSNorm: weight; LayerNorm: weight and bias)."""
        return self.hidden_size * (2 if self.arch == "gpt2" else 1)

    def layer_params(self, layer: int | None = None) -> int:
        """Parameters of one transformer block (two norms, attention, MLP): of global layer `layer`, or of a
        dense model's any layer (an MoE model has two kinds, so it needs the index)."""
        if layer is None:
            assert not self.is_moe, "an MoE model's layers differ: pass the layer index"
            return self.attention_params() + self.mlp_params() + 2 * self.norm_params()
        return self.attention_params() + self.layer_mlp_params(layer) + 2 * self.norm_params()

    def embedding_params(self) -> int:
        """Token embedding (and learned position embedding for gpt2)."""
        pos = self.max_seq_len * self.hidden_size if self.learned_positions else 0
        return self.vocab_size * self.hidden_size + pos

    def head_params(self) -> int:
        """Final norm and output projection (zero extra for the projection when embeddings are tied)."""
        proj = 0 if self.tied_embeddings else self.vocab_size * self.hidden_size
        return self.norm_params() + proj

    def num_params(self) -> int:
        layers = sum(self.layer_params(i) for i in range(self.num_layers)) if self.is_moe else \
            self.num_layers * self.layer_params()
        return self.embedding_params() + layers + self.head_params()

    def num_expert_params(self) -> int:
        """Routed-expert parameters of the whole model (what expert parallelism splits)."""
        return self.num_moe_layers * self.num_experts * self.expert_params()

    def num_active_params(self) -> int:
        """Parameters one token uses: all but the routed experts it is not sent to."""
        unused = self.num_moe_layers * (self.num_experts - self.num_experts_per_token) * self.expert_params()
        return self.num_params() - unused

    def to_dict(self) -> dict:
        return dataclass_to_dict(self)

    @classmethod
    def from_dict(cls, data: object, *, what: str = "model") -> "ModelSpec":
        return dataclass_from_dict(cls, data, what=what)


def _gpt(name: str, layers: int, hidden: int, heads: int) -> ModelSpec:
    # Megatron GPT shapes (SC21 Table 1): FFN 4h, vocab 51200, sequence 2048, tied embeddings.
    return ModelSpec(name=name, arch="gpt2", num_layers=layers, hidden_size=hidden, num_heads=heads,
                     num_kv_heads=heads, ffn_hidden_size=4 * hidden, vocab_size=51200, max_seq_len=2048,
                     tied_embeddings=True)


def _llama(name: str, layers: int, hidden: int, heads: int, kv: int, ffn: int, vocab: int,
           seq: int, tied: bool) -> ModelSpec:
    return ModelSpec(name=name, arch="llama", num_layers=layers, hidden_size=hidden, num_heads=heads,
                     num_kv_heads=kv, ffn_hidden_size=ffn, vocab_size=vocab, max_seq_len=seq,
                     tied_embeddings=tied)


def _llama3_rope(factor: float) -> dict:
    """Llama 3.1's / 3.2's rope_scaling: rope_type llama3 with low_freq_factor 1, high_freq_factor 4 and
    original_max_position_embeddings 8192 (their config.json files)."""
    return dict(rope_scaling="llama3", rope_scaling_factor=factor, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                rope_original_max_positions=8192)


def _moe(name: str, *, layers: int, hidden: int, heads: int, kv: int, ffn: int, vocab: int, seq: int,
         experts: int, top_k: int, expert_ffn: int, **more) -> ModelSpec:
    return ModelSpec(name=name, arch="llama", num_layers=layers, hidden_size=hidden, num_heads=heads, num_kv_heads=kv,
                     ffn_hidden_size=ffn, vocab_size=vocab, max_seq_len=seq, tied_embeddings=False,
                     num_experts=experts, num_experts_per_token=top_k, expert_ffn_hidden_size=expert_ffn, **more)


MOE_PRESETS = (
    # Small enough for CPU runs: 8 experts top-2 (every ep up to 4 divides them), a shared expert, one
    # leading dense layer, 4 layers (pp up to 4), the tiny model's attention.
    _moe("tiny-moe", layers=4, hidden=64, heads=8, kv=4, ffn=128, vocab=256, seq=128, experts=8, top_k=2,
         expert_ffn=32, shared_expert_ffn_hidden_size=32, num_dense_layers=1, aux_loss_coeff=0.01),
    # mistralai/Mixtral-8x7B-v0.1 config.json: hidden 4096, 32 layers, 32 heads, 8 KV heads, intermediate
    # 14336, vocab 32000, num_local_experts 8, num_experts_per_tok 2, router_aux_loss_coef 0.02,
    # max_position_embeddings 32768, rope_theta 1e6. 46.7B total, 12.9B active (Mistral's announcement).
    _moe("mixtral-8x7b", layers=32, hidden=4096, heads=32, kv=8, ffn=14336, vocab=32000, seq=32768, experts=8,
         top_k=2, expert_ffn=14336, aux_loss_coeff=0.02, rope_base=1e6),
    # mistralai/Mixtral-8x22B-v0.1 config.json: hidden 6144, 56 layers, 48 heads, 8 KV heads, intermediate
    # 16384, vocab 32000, 8 experts top-2, max_position_embeddings 65536, rope_theta 1e6. 141B total, 39B active.
    _moe("mixtral-8x22b", layers=56, hidden=6144, heads=48, kv=8, ffn=16384, vocab=32000, seq=65536, experts=8,
         top_k=2, expert_ffn=16384, aux_loss_coeff=0.001, rope_base=1e6),
    # Qwen/Qwen3-30B-A3B config.json: hidden 2048, 48 layers, 32 heads of head_dim 128, 4 KV heads,
    # moe_intermediate_size 768, 128 experts, num_experts_per_tok 8, vocab 151936, untied, qk norm,
    # router_aux_loss_coef 0.001, max_position_embeddings 40960, rope_theta 1e6, rms_norm_eps 1e-6 (as every
    # Qwen and DeepSeek config here; Llama's and Mixtral's 1e-5). 30.5B total, 3.3B active
    # (Qwen3 report).
    _moe("qwen3-30b-a3b", layers=48, hidden=2048, heads=32, kv=4, ffn=6144, vocab=151936, seq=40960, experts=128,
         top_k=8, expert_ffn=768, attention_head_dim=128, qk_norm=True, aux_loss_coeff=0.001, rope_base=1e6,
         norm_eps=1e-6),
    # Qwen/Qwen3-235B-A22B config.json: hidden 4096, 94 layers, 64 heads of head_dim 128, 4 KV heads,
    # moe_intermediate_size 1536, 128 experts top-8, vocab 151936, untied, qk norm, max_position_embeddings
    # 40960, rope_theta 1e6. 235B total, 22B active (Qwen3 report).
    _moe("qwen3-235b-a22b", layers=94, hidden=4096, heads=64, kv=4, ffn=12288, vocab=151936, seq=40960, experts=128,
         top_k=8, expert_ffn=1536, attention_head_dim=128, qk_norm=True, aux_loss_coeff=0.001, rope_base=1e6,
         norm_eps=1e-6),
    # deepseek-ai/DeepSeek-V3 config.json: hidden 7168, 61 layers (first_k_dense_replace 3 dense of
    # intermediate 18432), 128 heads, MLA q_lora_rank 1536, kv_lora_rank 512, qk_nope_head_dim 128,
    # qk_rope_head_dim 64, v_head_dim 128, 256 routed experts of moe_intermediate_size 2048, 1 shared expert,
    # num_experts_per_tok 8, vocab 129280, max_position_embeddings 163840, aux_loss_alpha 0.001 (seq_aux),
    # topk_method noaux_tc (bias-adjusted, auxiliary-loss-free balancing), rope_theta 10000 (YaRN-scaled
    # there; unscaled here). 671B total, 37B active (DeepSeek-V3 report; the 14B multi-token-prediction module is not counted).
    _moe("deepseek-v3", layers=61, hidden=7168, heads=128, kv=128, ffn=18432, vocab=129280, seq=163840,
         experts=256, top_k=8, expert_ffn=2048, shared_expert_ffn_hidden_size=2048, num_dense_layers=3,
         aux_loss_coeff=0.001, load_balancing="aux_free", q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
         qk_rope_head_dim=64, v_head_dim=128, rope_base=10000.0, norm_eps=1e-6),
)

PRESETS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        # Small enough that a step takes milliseconds on one CPU core, shaped so that every parallel
        # degree up to 4 divides it (8 heads, 4 KV heads, 8 layers for pp x virtual stages).
        _llama("tiny", 8, 64, 8, 4, 176, 256, 128, False),
        _gpt("gpt3-1.7b", 24, 2304, 24),
        _gpt("gpt3-3.6b", 30, 3072, 32),
        _gpt("gpt3-7.5b", 36, 4096, 32),
        _gpt("gpt3-18b", 40, 6144, 48),
        _gpt("gpt3-39b", 48, 8192, 64),
        _gpt("gpt3-76b", 60, 10240, 80),
        _gpt("gpt3-145b", 80, 12288, 96),
        _gpt("gpt3-175b", 96, 12288, 96),
        _gpt("gpt3-310b", 96, 16384, 128),
        _gpt("gpt3-530b", 105, 20480, 128),
        _gpt("gpt3-1t", 128, 25600, 160),
        # meta-llama/Llama-3.2-1B config.json: rope_scaling llama3, factor 32 (low 1, high 4, original 8192).
        dataclasses.replace(_llama("llama3.2-1b", 16, 2048, 32, 8, 8192, 128256, 8192, True), **_llama3_rope(32.0)),
        _llama("llama3-8b", 32, 4096, 32, 8, 14336, 128256, 8192, False),
        _llama("llama3-70b", 80, 8192, 64, 8, 28672, 128256, 8192, False),
        # The 405B model exists as Llama 3.1 only: its config's llama3 rope scaling, factor 8.
        dataclasses.replace(_llama("llama3-405b", 126, 16384, 128, 8, 53248, 128256, 8192, False), **_llama3_rope(8.0)),
        # Llama 3.1: Llama 3's shapes with the 131072-token context its config.json allows by its llama3
        # rope scaling (factor 8, low 1, high 4, original 8192), which the engine and every export run.
        dataclasses.replace(_llama("llama3.1-8b", 32, 4096, 32, 8, 14336, 128256, 131072, False), **_llama3_rope(8.0)),
        dataclasses.replace(_llama("llama3.1-70b", 80, 8192, 64, 8, 28672, 128256, 131072, False), **_llama3_rope(8.0)),
        # Qwen/Qwen2.5-7B config.json: hidden 3584, 28 layers, 28 heads, 4 KV heads, intermediate 18944, vocab
        # 152064, max_position_embeddings 131072, rope_theta 1e6, rms_norm_eps 1e-6, untied, q/k/v biases
        # (Qwen2's attention).
        dataclasses.replace(_llama("qwen2.5-7b", 28, 3584, 28, 4, 18944, 152064, 131072, False), qkv_bias=True,
                            rope_base=1e6, norm_eps=1e-6),
        # Qwen/Qwen3-8B config.json: hidden 4096, 36 layers, 32 heads of head_dim 128, 8 KV heads, intermediate
        # 12288, vocab 151936, max_position_embeddings 40960, rope_theta 1e6, rms_norm_eps 1e-6, untied, no
        # attention bias, query/key head norms.
        dataclasses.replace(_llama("qwen3-8b", 36, 4096, 32, 8, 12288, 151936, 40960, False), attention_head_dim=128,
                            qk_norm=True, rope_base=1e6, norm_eps=1e-6),
        *MOE_PRESETS,
    )
}


def suggest(name: str, choices: list[str]) -> str:
    """' (did you mean X?)' for the closest names, or ''."""
    close = difflib.get_close_matches(name, choices, n=3, cutoff=0.5)
    return f" (did you mean {', '.join(close)}?)" if close else ""


def _require(cfg: dict, key: str, path: Path) -> object:
    if key not in cfg:
        raise PlannerError(f"config {path}: missing key {key!r}")
    return cfg[key]


def _int_key(cfg: dict, key: str, path: Path) -> int:
    value = _require(cfg, key, path)
    if isinstance(value, bool) or not isinstance(value, int):
        raise PlannerError(f"config {path}: key {key!r} must be an integer, got {value!r}")
    return value


def _float_key(cfg: dict, key: str, path: Path, default: float) -> float:
    value = cfg.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise PlannerError(f"config {path}: key {key!r} must be a number, got {value!r}")
    return float(value)


# GPT-2 configs' activation_function (transformers' ACT2FN names): exact GELU, or its tanh approximation.
GELU_APPROXIMATION = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu_fast": "tanh"}


def _gelu(cfg: dict, path: Path) -> str:
    act = cfg.get("activation_function", "gelu_new")  # transformers' GPT2Config default
    if not isinstance(act, str) or act not in GELU_APPROXIMATION:
        raise PlannerError(f"config {path}: key 'activation_function' {act!r} is not supported (use "
                           f"{', '.join(GELU_APPROXIMATION)})")
    return GELU_APPROXIMATION[act]


def _bool_key(cfg: dict, key: str, path: Path, default: bool) -> bool:
    value = cfg.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise PlannerError(f"config {path}: key {key!r} must be true or false, got {value!r}")
    return value


def _leading_dense_layers(cfg: dict, path: Path) -> int:
    """Qwen-MoE's decoder_sparse_step / mlp_only_layers can interleave dense layers; only leading dense layers
    are expressed (num_dense_layers): mlp_only_layers 0 .. k - 1, every later layer MoE."""
    step = cfg.get("decoder_sparse_step", 1)
    if step != 1:
        raise PlannerError(f"config {path}: key 'decoder_sparse_step' {step!r} is not supported (only 1: every layer MoE)")
    dense = cfg.get("mlp_only_layers") or []
    if dense != list(range(len(dense))):
        raise PlannerError(f"config {path}: key 'mlp_only_layers' {dense!r} is not supported (only leading dense "
                           f"layers 0, 1, ...)")
    return len(dense)


def _llama_common(cfg: dict, path: Path, name: str, eps_default: float = 1e-6) -> dict:
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise PlannerError(f"config {path}: key 'hidden_act' {act!r} is not supported (SwiGLU with silu only)")
    heads = _int_key(cfg, "num_attention_heads", path)
    kv = _int_key(cfg, "num_key_value_heads", path) if cfg.get("num_key_value_heads") is not None else heads
    return dict(name=name, arch="llama", num_layers=_int_key(cfg, "num_hidden_layers", path),
                hidden_size=_int_key(cfg, "hidden_size", path), num_heads=heads, num_kv_heads=kv,
                ffn_hidden_size=_int_key(cfg, "intermediate_size", path), vocab_size=_int_key(cfg, "vocab_size", path),
                max_seq_len=_int_key(cfg, "max_position_embeddings", path),
                tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                norm_eps=_float_key(cfg, "rms_norm_eps", path, eps_default), **_rope_fields(cfg, path))


def _no_sliding_window(cfg: dict, path: Path) -> None:
    """Qwen configs may turn on sliding-window attention; only full causal attention is priced and run."""
    if cfg.get("use_sliding_window"):
        raise PlannerError(f"config {path}: key 'use_sliding_window' true is not supported (full causal attention "
                           f"only)")


def _rope_fields(cfg: dict, path: Path) -> dict:
    """RoPE base and scaling: transformers 5 writes both in `rope_parameters` (rope_theta, rope_type, ...),
    earlier versions `rope_theta` and `rope_scaling` (null, or rope_type / type with its parameters)."""
    params = cfg.get("rope_parameters")
    key = "rope_parameters" if params is not None else "rope_scaling"
    scaling = params if params is not None else cfg.get("rope_scaling")
    if scaling is not None and not isinstance(scaling, dict):
        raise PlannerError(f"config {path}: key {key!r} must be an object or null, got {scaling!r}")
    scaling = scaling or {}
    base = (_float_key(scaling, "rope_theta", path, 10000.0) if "rope_theta" in scaling
            else _float_key(cfg, "rope_theta", path, 10000.0))  # transformers' default
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    kind = "none" if kind == "default" else kind
    if kind not in ROPE_SCALINGS:
        raise PlannerError(f"config {path}: {key} rope_type {kind!r} is not supported (use default, "
                           f"{', '.join(ROPE_SCALINGS[1:])})")
    if kind != "llama3":
        return dict(rope_base=base, rope_scaling=kind)
    missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
               if k not in scaling]
    if missing:
        raise PlannerError(f"config {path}: {key} of rope_type llama3 misses {missing[0]!r}")
    return dict(rope_base=base, rope_scaling=kind, rope_scaling_factor=_float_key(scaling, "factor", path, 1.0),
                rope_low_freq_factor=_float_key(scaling, "low_freq_factor", path, 1.0),
                rope_high_freq_factor=_float_key(scaling, "high_freq_factor", path, 4.0),
                rope_original_max_positions=_int_key(scaling, "original_max_position_embeddings", path))


def _llama_attention(cfg: dict, path: Path) -> dict:
    """A llama config's attention: no biases (attention_bias / mlp_bias true are refused) and its head_dim
    where it says one other than hidden_size / heads."""
    for key in ("attention_bias", "mlp_bias"):
        if cfg.get(key):
            raise PlannerError(f"config {path}: key {key!r} true is not supported for llama (no biases)")
    head_dim = cfg.get("head_dim")
    if head_dim is None:
        return {}
    head_dim = _int_key(cfg, "head_dim", path)
    return {} if head_dim * _int_key(cfg, "num_attention_heads", path) == _int_key(cfg, "hidden_size", path) else dict(
        attention_head_dim=head_dim)


def _qwen_attention(cfg: dict, path: Path, model_type: str) -> dict:
    """Qwen2's q/k/v biases, or Qwen3's explicit head_dim and per-head query/key norms."""
    _no_sliding_window(cfg, path)
    if model_type in ("qwen2", "qwen2_moe"):
        return dict(qkv_bias=True)
    if cfg.get("attention_bias"):  # Qwen3's attention_bias also puts a bias on the output projection
        raise PlannerError(f"config {path}: key 'attention_bias' true is not supported for {model_type} (biases on q, "
                           f"k, v and the output projection; only Qwen2's q/k/v biases are modelled)")
    head_dim = _int_key(cfg, "head_dim", path) if cfg.get("head_dim") is not None else 0
    return dict(attention_head_dim=head_dim, qk_norm=True)


def _moe_fields(cfg: dict, path: Path, model_type: str) -> dict:
    """The MoE (and attention-variant) fields of a mixtral, qwen2_moe, qwen3_moe or deepseek_v3 config."""
    if model_type == "mixtral":
        if cfg.get("sliding_window") is not None:
            raise PlannerError(f"config {path}: key 'sliding_window' {cfg['sliding_window']!r} is not supported (full "
                               f"causal attention only; Mixtral's own configs say null)")
        return dict(num_experts=_int_key(cfg, "num_local_experts", path),
                    num_experts_per_token=_int_key(cfg, "num_experts_per_tok", path),
                    expert_ffn_hidden_size=_int_key(cfg, "intermediate_size", path),
                    aux_loss_coeff=_float_key(cfg, "router_aux_loss_coef", path, 0.001))
    common = dict(num_experts_per_token=_int_key(cfg, "num_experts_per_tok", path),
                  expert_ffn_hidden_size=_int_key(cfg, "moe_intermediate_size", path))
    if model_type in ("qwen2_moe", "qwen3_moe"):
        common.update(num_dense_layers=_leading_dense_layers(cfg, path), num_experts=_int_key(cfg, "num_experts", path),
                      aux_loss_coeff=_float_key(cfg, "router_aux_loss_coef", path, 0.001),
                      norm_topk_prob=_bool_key(cfg, "norm_topk_prob", path, False))  # transformers' default
        common.update(_qwen_attention(cfg, path, model_type))
        if model_type == "qwen2_moe":
            shared = _int_key(cfg, "shared_expert_intermediate_size", path)
            return dict(common, shared_expert_ffn_hidden_size=shared, shared_expert_gate=shared > 0)
        return common
    shared = _int_key(cfg, "n_shared_experts", path) if cfg.get("n_shared_experts") is not None else 0
    q_lora = _int_key(cfg, "q_lora_rank", path) if cfg.get("q_lora_rank") is not None else 0
    return dict(common, num_experts=_int_key(cfg, "n_routed_experts", path),
                shared_expert_ffn_hidden_size=shared * common["expert_ffn_hidden_size"],
                num_dense_layers=_int_key(cfg, "first_k_dense_replace", path),
                aux_loss_coeff=_float_key(cfg, "aux_loss_alpha", path, 0.001), q_lora_rank=q_lora,
                # DeepSeek-V3's noaux_tc: top-k over bias-adjusted scores (its report, section 2.1.2).
                load_balancing="aux_free" if cfg.get("topk_method") == "noaux_tc" else "aux_loss",
                kv_lora_rank=_int_key(cfg, "kv_lora_rank", path), qk_nope_head_dim=_int_key(cfg, "qk_nope_head_dim", path),
                qk_rope_head_dim=_int_key(cfg, "qk_rope_head_dim", path), v_head_dim=_int_key(cfg, "v_head_dim", path))


MOE_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3")
# Dense llama-style blocks with Qwen's attention (_qwen_attention).
QWEN_MODEL_TYPES = ("qwen2", "qwen3")


def model_from_hf_config(path: str | Path) -> ModelSpec:
    """Read an HF `config.json` (model_type llama, qwen2, qwen3, gpt2, mixtral, qwen2_moe, qwen3_moe or
    deepseek_v3) with the key names HF writes."""
    path = Path(path)
    cfg = read_json_file(path, what="model config")
    if not isinstance(cfg, dict):
        raise PlannerError(f"config {path}: expected a JSON object")
    model_type = _require(cfg, "model_type", path)
    name = path.parent.name or path.stem
    try:
        if model_type == "llama":
            return ModelSpec(**_llama_common(cfg, path, name), **_llama_attention(cfg, path))
        if model_type in MOE_MODEL_TYPES:
            # transformers' default rms_norm_eps: Mixtral's 1e-5, the others' 1e-6
            eps = 1e-5 if model_type == "mixtral" else 1e-6
            return ModelSpec(**_llama_common(cfg, path, name, eps), **_moe_fields(cfg, path, model_type))
        if model_type in QWEN_MODEL_TYPES:
            return ModelSpec(**_llama_common(cfg, path, name), **_qwen_attention(cfg, path, model_type))
        if model_type == "gpt2":
            hidden = _int_key(cfg, "n_embd", path)
            heads = _int_key(cfg, "n_head", path)
            inner = cfg.get("n_inner")
            return ModelSpec(
                name=name, arch="gpt2", num_layers=_int_key(cfg, "n_layer", path), hidden_size=hidden,
                num_heads=heads, num_kv_heads=heads,
                ffn_hidden_size=inner if isinstance(inner, int) and not isinstance(inner, bool) else 4 * hidden,
                vocab_size=_int_key(cfg, "vocab_size", path),
                max_seq_len=_int_key(cfg, "n_positions", path),
                tied_embeddings=bool(cfg.get("tie_word_embeddings", True)),
                norm_eps=_float_key(cfg, "layer_norm_epsilon", path, 1e-5), gelu_approximation=_gelu(cfg, path))
    except ValueError as exc:
        if isinstance(exc, PlannerError):
            raise
        raise PlannerError(f"config {path}: {exc}") from None
    raise PlannerError(f"config {path}: model_type {model_type!r} is not supported (use llama, gpt2, "
                       f"{', '.join(QWEN_MODEL_TYPES + MOE_MODEL_TYPES)})")


def resolve_model(name_or_path: str) -> ModelSpec:
    """A preset by name, an HF config.json, or a planner model JSON (the `ModelSpec` form)."""
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    path = Path(name_or_path)
    if path.is_dir() and (path / "config.json").exists():
        path = path / "config.json"
    if path.suffix == ".json" or path.exists():
        data = read_json_file(path, what="model config")
        if isinstance(data, dict) and "model_type" not in data and "arch" in data:
            return ModelSpec.from_dict(data, what=f"model {path}")
        return model_from_hf_config(path)
    raise PlannerError(f"unknown model {name_or_path!r}{suggest(name_or_path, list(PRESETS))}; "
                       f"presets: {', '.join(PRESETS)}")


def with_overrides(spec: ModelSpec, **changes: object) -> ModelSpec:
    """A copy of `spec` with some fields changed (validated again)."""
    try:
        return dataclasses.replace(spec, **changes)
    except ValueError as exc:
        raise PlannerError(f"model {spec.name}: {exc}") from None
