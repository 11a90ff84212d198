"""ModelConfig: the shape of a decoder, read from a config.json-style dict."""

from __future__ import annotations

from dataclasses import dataclass

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")


@dataclass(slots=True, frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling_factor: float          # linear position scaling; 1.0 means none
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool                      # Qwen2
    qk_norm: bool                       # Qwen3
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_hf(cls, hf: dict) -> "ModelConfig":
        arch = str(hf.get("model_type", "")).lower()
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported model architecture {arch!r}; "
                             f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        return cls(
            architecture=arch,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or hidden // heads),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=float(_rope_theta(hf)),
            rope_scaling_factor=_linear_rope_factor(hf.get("rope_scaling") or hf.get("rope_parameters")),
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=bool(hf.get("attention_bias", arch == "qwen2")),
            qk_norm=arch == "qwen3",
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=_as_tuple(hf.get("eos_token_id")),
        )

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V one token keeps across all layers, per element byte."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim


def _rope_theta(hf: dict) -> float:
    if "rope_theta" in hf:
        return hf["rope_theta"]
    params = hf.get("rope_parameters") or {}
    return params.get("rope_theta", 10000.0)


def _linear_rope_factor(scaling: dict | None) -> float:
    if not scaling:
        return 1.0
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return 1.0
    if kind != "linear":
        raise ValueError(f"unsupported rope scaling {kind!r}; supported: default, linear")
    return float(scaling["factor"])


def _as_tuple(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return (int(value),)
