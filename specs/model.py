"""What is trained: the transformer's shape, from a preset or an HF-style config.json.

Parameter counts follow the architecture exactly (GQA key/value heads, SwiGLU's three MLP matrices,
biases and LayerNorm for GPT-2, tied or separate embeddings) because every one of them changes the
memory and communication the cost model prices.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass
from pathlib import Path

from specs.errors import PlannerError
from specs.jsonio import dataclass_from_dict, dataclass_to_dict, read_json_file

ARCHS = ("llama", "gpt2")


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

    # --- shape helpers -------------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

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
        """The RoPE base of a llama model (Llama 3's, without scaling), None for learned positions; the engine
        and every export use it."""
        return 500000.0 if self.arch == "llama" else None

    @property
    def norm_eps(self) -> float:
        """The RMSNorm / LayerNorm epsilon."""
        return 1e-5

    # --- parameter counts ----------------------------------------------------------------------
    def attention_params(self) -> int:
        h, kv = self.hidden_size, self.kv_dim
        weights = h * h + 2 * h * kv + h * h
        biases = (h + 2 * kv + h) if self.has_bias else 0
        return weights + biases

    def mlp_params(self) -> int:
        h, f = self.hidden_size, self.ffn_hidden_size
        if self.gated_mlp:
            return 3 * h * f
        return 2 * h * f + ((f + h) if self.has_bias else 0)

    def norm_params(self) -> int:
        """Parameters of one normalisation layer (RMSNorm: weight; LayerNorm: weight and bias)."""
        return self.hidden_size * (2 if self.arch == "gpt2" else 1)

    def layer_params(self) -> int:
        """Parameters of one transformer block (two norms, attention, MLP)."""
        return self.attention_params() + self.mlp_params() + 2 * self.norm_params()

    def embedding_params(self) -> int:
        """Token embedding (and learned position embedding for gpt2)."""
        pos = self.max_seq_len * self.hidden_size if self.learned_positions else 0
        return self.vocab_size * self.hidden_size + pos

    def head_params(self) -> int:
        """Final norm and output projection (zero extra for the projection when embeddings are tied)."""
        proj = 0 if self.tied_embeddings else self.vocab_size * self.hidden_size
        return self.norm_params() + proj

    def num_params(self) -> int:
        return self.embedding_params() + self.num_layers * self.layer_params() + self.head_params()

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
        _llama("llama3.2-1b", 16, 2048, 32, 8, 8192, 128256, 8192, True),
        _llama("llama3-8b", 32, 4096, 32, 8, 14336, 128256, 8192, False),
        _llama("llama3-70b", 80, 8192, 64, 8, 28672, 128256, 8192, False),
        _llama("llama3-405b", 126, 16384, 128, 8, 53248, 128256, 8192, False),
        # Llama 3.1: Llama 3's shapes with the 131072-token context its config.json allows (rope scaling).
        # The engine and the exports use unscaled RoPE (ModelSpec.rope_theta); the cost is the same.
        _llama("llama3.1-8b", 32, 4096, 32, 8, 14336, 128256, 131072, False),
        _llama("llama3.1-70b", 80, 8192, 64, 8, 28672, 128256, 131072, False),
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


def model_from_hf_config(path: str | Path) -> ModelSpec:
    """Read an HF `config.json` (model_type llama or gpt2) with the key names HF writes."""
    path = Path(path)
    cfg = read_json_file(path, what="model config")
    if not isinstance(cfg, dict):
        raise PlannerError(f"config {path}: expected a JSON object")
    model_type = _require(cfg, "model_type", path)
    name = path.parent.name or path.stem
    try:
        if model_type == "llama":
            heads = _int_key(cfg, "num_attention_heads", path)
            kv = _int_key(cfg, "num_key_value_heads", path) if cfg.get("num_key_value_heads") is not None else heads
            return ModelSpec(
                name=name, arch="llama", num_layers=_int_key(cfg, "num_hidden_layers", path),
                hidden_size=_int_key(cfg, "hidden_size", path), num_heads=heads, num_kv_heads=kv,
                ffn_hidden_size=_int_key(cfg, "intermediate_size", path),
                vocab_size=_int_key(cfg, "vocab_size", path),
                max_seq_len=_int_key(cfg, "max_position_embeddings", path),
                tied_embeddings=bool(cfg.get("tie_word_embeddings", False)))
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
                tied_embeddings=bool(cfg.get("tie_word_embeddings", True)))
    except ValueError as exc:
        if isinstance(exc, PlannerError):
            raise
        raise PlannerError(f"config {path}: {exc}") from None
    raise PlannerError(f"config {path}: model_type {model_type!r} is not supported (use llama or gpt2)")


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
