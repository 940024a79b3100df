"""The model's shape, read from a Hugging Face `config.json`.

One dataclass holds every number the forward pass needs. It is parsed from the
same file `transformers` reads, so a checkpoint folder means the same thing to
both libraries:

>>> cfg = ModelConfig.tiny()
>>> cfg.n_heads // cfg.n_kv_heads   # query heads that share one KV head
2
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM",)


def nanoserve_home() -> Path:
    """Where fetched models and built kernels live, outside any clone: $NANOSERVE_HOME, else ~/.cache/nanoserve."""
    return Path(os.environ.get("NANOSERVE_HOME", Path.home() / ".cache" / "nanoserve"))


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be loaded: names the file and what is wrong."""


@dataclass
class ModelConfig:
    vocab_size: int = 49152
    hidden_size: int = 576
    intermediate_size: int = 1536
    n_layers: int = 30
    n_heads: int = 9
    n_kv_heads: int = 3
    head_dim: int = 64
    max_position_embeddings: int = 8192
    rms_norm_eps: float = 1e-5
    rope_theta: float = 100000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = True
    bos_token_id: int | None = 1
    eos_token_id: list[int] = field(default_factory=lambda: [2])

    def __post_init__(self) -> None:
        if self.hidden_size <= 0 or self.n_layers <= 0 or self.vocab_size <= 0:
            raise CheckpointError(f"config: sizes must be positive, got {self}")
        if self.n_heads % self.n_kv_heads:
            raise CheckpointError(
                f"config: num_attention_heads={self.n_heads} is not a multiple of "
                f"num_key_value_heads={self.n_kv_heads}"
            )
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if kind not in ("llama3", "default", None):
                raise CheckpointError(f"config: rope_scaling type {kind!r} is not supported (llama3 is)")

    @property
    def n_rep(self) -> int:
        """How many query heads read each KV head (grouped-query attention)."""
        return self.n_heads // self.n_kv_heads

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], source: str = "config.json") -> ModelConfig:
        arch = d.get("architectures") or [None]
        if d.get("model_type") != "llama" and arch[0] not in SUPPORTED_ARCHITECTURES:
            raise CheckpointError(
                f"{source}: unsupported architecture {arch[0] or d.get('model_type')!r}; "
                f"nanoserve loads {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        try:
            n_heads = int(d["num_attention_heads"])
            hidden = int(d["hidden_size"])
            eos = d.get("eos_token_id", 2)
            return cls(
                vocab_size=int(d["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(d["intermediate_size"]),
                n_layers=int(d["num_hidden_layers"]),
                n_heads=n_heads,
                n_kv_heads=int(d.get("num_key_value_heads") or n_heads),
                head_dim=int(d.get("head_dim") or hidden // n_heads),
                max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                rope_theta=float(d.get("rope_theta", (d.get("rope_parameters") or {}).get("rope_theta", 10000.0))),
                rope_scaling=d.get("rope_scaling"),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                bos_token_id=d.get("bos_token_id"),
                eos_token_id=list(eos) if isinstance(eos, list) else ([eos] if eos is not None else []),
            )
        except KeyError as e:
            raise CheckpointError(f"{source}: missing key {e.args[0]!r}") from None

    @classmethod
    def from_folder(cls, folder: str | Path) -> ModelConfig:
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise CheckpointError(f"{path}: config.json not found; is this a checkpoint folder?")
        try:
            d = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{path}: not valid JSON ({e})") from None
        return cls.from_hf_dict(d, source=str(path))

    def to_hf_dict(self) -> dict[str, Any]:
        """The config.json that `transformers.LlamaConfig` reads."""
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.n_layers,
            "num_attention_heads": self.n_heads,
            "num_key_value_heads": self.n_kv_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id[0] if len(self.eos_token_id) == 1 else self.eos_token_id,
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "torch_dtype": "float32",
        }

    @classmethod
    def tiny(cls, **overrides: Any) -> ModelConfig:
        """A random-weight config small enough for unit tests (same architecture, tiny sizes)."""
        base = dict(
            vocab_size=256, hidden_size=64, intermediate_size=128, n_layers=2, n_heads=4,
            n_kv_heads=2, head_dim=16, max_position_embeddings=512, rope_theta=10000.0,
            tie_word_embeddings=True, bos_token_id=1, eos_token_id=[2],
        )
        base.update(overrides)
        return cls(**base)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
