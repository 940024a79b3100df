"""Every configuration in one place: the model's, the KV cache's, the scheduler's, speculative decoding's.

`ModelConfig` holds every number the forward pass needs, parsed from the same `config.json`
`transformers` reads, so a checkpoint folder means the same thing to both libraries. The engine's
knobs sit beside it with vLLM's names and one set of defaults (`EngineConfig`), which `LLM`,
`LLMEngine`, `serve` and the benchmarks all take:

>>> cfg = ModelConfig.tiny()
>>> cfg.n_heads // cfg.n_kv_heads   # query heads that share one KV head
2
>>> kv_bytes_per_token(cfg, 4)      # 2 (K and V) x layers x kv heads x head_dim x 4 bytes
512
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

ARCHITECTURES = {"LlamaForCausalLM": "llama", "Gemma3ForCausalLM": "gemma3_text"}
"""The architectures a config may name, each with the model_type transformers writes beside it; `model.registry`
maps each to its family's class (a test keeps the two the same)."""
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)
LAYER_TYPES = ("full_attention", "sliding_attention")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


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
    # a family's own numbers; the defaults are Llama's (Gemma 3's in `from_hf_dict`)
    architecture: str = "LlamaForCausalLM"
    layer_types: list[str] | None = None  # per layer "sliding_attention" or "full_attention"; None: every one full
    sliding_window: int | None = None  # positions a sliding layer's query sees, itself included
    rope_local_theta: float | None = None  # RoPE base of the sliding layers (None: rope_theta)
    query_pre_attn_scalar: int | None = None  # attention scores are scaled by its -0.5 power (None: head_dim)
    hidden_activation: str = "silu"  # the MLP's gate: silu (SwiGLU) or gelu_pytorch_tanh (GeGLU)

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise CheckpointError(f"config: architecture {self.architecture!r} is not one of {SUPPORTED_ARCHITECTURES}")
        if self.hidden_activation not in ACTIVATIONS:
            raise CheckpointError(f"config: hidden_activation {self.hidden_activation!r} is not one of {ACTIVATIONS}")
        if self.layer_types is not None:
            if len(self.layer_types) != self.n_layers or not set(self.layer_types) <= set(LAYER_TYPES):
                raise CheckpointError(f"config: layer_types must name {self.n_layers} layers, each one of "
                                      f"{LAYER_TYPES}; got {self.layer_types}")
            if "sliding_attention" in self.layer_types and not (self.sliding_window or 0) > 0:
                raise CheckpointError(f"config: sliding layers need a positive sliding_window, "
                                      f"got {self.sliding_window}")
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

    def window(self, layer: int) -> int | None:
        """The sliding window layer `layer` attends within (its query and the window - 1 keys before it), or None
        for a layer that sees every earlier position."""
        if self.layer_types is None or self.layer_types[layer] != "sliding_attention":
            return None
        return self.sliding_window

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], source: str = "config.json") -> ModelConfig:
        arch = (d.get("architectures") or [None])[0]
        if arch not in ARCHITECTURES:  # an architecture named otherwise, known by its model_type (llama)
            arch = next((a for a, t in ARCHITECTURES.items() if t == d.get("model_type")), None)
        if arch is None:
            raise CheckpointError(
                f"{source}: unsupported architecture {(d.get('architectures') or [None])[0] or d.get('model_type')!r}; "
                f"nanoserve loads {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        gemma = arch == "Gemma3ForCausalLM"
        try:
            n_heads = int(d["num_attention_heads"])
            hidden = int(d["hidden_size"])
            eos = d.get("eos_token_id", 1 if gemma else 2)
            rope = d.get("rope_parameters") or {}
            common = dict(
                vocab_size=int(d["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(d["intermediate_size"]),
                n_layers=int(d["num_hidden_layers"]),
                n_heads=n_heads,
                n_kv_heads=int(d.get("num_key_value_heads") or n_heads),
                head_dim=int(d.get("head_dim") or hidden // n_heads),
                bos_token_id=d.get("bos_token_id", 2 if gemma else None),
                eos_token_id=list(eos) if isinstance(eos, list) else ([eos] if eos is not None else []),
            )
            if gemma:
                return cls(**common, **_gemma3_fields(d, common["n_layers"], source))
            return cls(
                **common,
                max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                rope_theta=float(d.get("rope_theta", rope.get("rope_theta", 10000.0))),
                rope_scaling=d.get("rope_scaling"),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
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
        """The config.json that transformers reads: `LlamaConfig`'s, or `Gemma3TextConfig`'s (the numbers both
        families have, then each family's own)."""
        gemma = self.architecture == "Gemma3ForCausalLM"
        d = {
            "architectures": [self.architecture], "model_type": ARCHITECTURES[self.architecture],
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.n_layers,
            "num_attention_heads": self.n_heads, "num_key_value_heads": self.n_kv_heads, "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings, "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta, "rope_scaling": None if gemma else self.rope_scaling,
            "tie_word_embeddings": self.tie_word_embeddings, "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id[0] if len(self.eos_token_id) == 1 else self.eos_token_id,
            "attention_bias": False, "torch_dtype": "float32",
        }
        if not gemma:  # LlamaConfig's own keys among the last ones, in the order SmolLM2's config.json has them
            return {k: v for k, v in d.items() if k not in ("attention_bias", "torch_dtype")} | {
                "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "torch_dtype": "float32"}
        return d | {
            "rope_local_base_freq": self.rope_local_theta, "sliding_window": self.sliding_window,
            "layer_types": self.layer_types, "query_pre_attn_scalar": self.query_pre_attn_scalar,
            "hidden_activation": self.hidden_activation, "final_logit_softcapping": None,
            "attn_logit_softcapping": None, "pad_token_id": 0,
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

    @classmethod
    def tiny_gemma3(cls, **overrides: Any) -> ModelConfig:
        """A random-weight Gemma 3 config for unit tests: two sliding layers of window 8, then a full one; a
        query scale that is not head_dim's."""
        base = dict(
            architecture="Gemma3ForCausalLM", vocab_size=256, hidden_size=64, intermediate_size=128, n_layers=3,
            n_heads=4, n_kv_heads=1, head_dim=32, max_position_embeddings=512, rms_norm_eps=1e-6,
            rope_theta=1_000_000.0, rope_local_theta=10_000.0, tie_word_embeddings=True, bos_token_id=2,
            eos_token_id=[1], layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            sliding_window=8, query_pre_attn_scalar=48, hidden_activation="gelu_pytorch_tanh",
        )
        base.update(overrides)
        return cls(**base)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _gemma3_fields(d: dict[str, Any], n_layers: int, source: str) -> dict[str, Any]:
    """Gemma 3's numbers from its config.json, with Gemma3TextConfig's defaults; what the forward does not
    compute (soft-capping, bidirectional attention, scaled RoPE) is refused by name."""
    for key in ("final_logit_softcapping", "attn_logit_softcapping", "use_bidirectional_attention"):
        if d.get(key):
            raise CheckpointError(f"{source}: {key}={d[key]!r} is not supported")
    rope = d.get("rope_parameters") or {}
    full, local = rope.get("full_attention") or {}, rope.get("sliding_attention") or {}
    for r in (full, local, d.get("rope_scaling") or {}):
        if r.get("rope_type", r.get("type", "default")) != "default":
            raise CheckpointError(f"{source}: RoPE scaling {r} is not supported for Gemma 3")
    pattern = int(d.get("sliding_window_pattern", 6))
    layer_types = d.get("layer_types") or ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                           for i in range(n_layers)]
    return dict(
        architecture="Gemma3ForCausalLM",
        max_position_embeddings=int(d.get("max_position_embeddings", 131_072)),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        rope_theta=float(full.get("rope_theta", d.get("rope_theta", 1_000_000.0))),
        rope_local_theta=float(local.get("rope_theta", d.get("rope_local_base_freq", 10_000.0))),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", True)),
        layer_types=list(layer_types),
        sliding_window=int(d.get("sliding_window", 4096)),
        query_pre_attn_scalar=int(d.get("query_pre_attn_scalar", 256)),
        hidden_activation=str(d.get("hidden_activation", "gelu_pytorch_tanh")),
    )


SAMPLING_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def generation_defaults(folder: str | Path) -> dict[str, Any]:
    """The sampling a checkpoint recommends: the fields of its generation_config.json that SamplingParams has
    (vLLM's behaviour). {} when the folder has none: then OpenAI's defaults hold (temperature 1, top_p 1)."""
    path = Path(folder) / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        d = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    if d.get("do_sample") is False:  # transformers' way of saying greedy
        return {"temperature": 0.0}
    return {k: d[k] for k in SAMPLING_DEFAULT_KEYS if isinstance(d.get(k), (int, float)) and not isinstance(d[k], bool)}


def kv_bytes_per_token(cfg: ModelConfig, dtype_bytes: int = 4) -> int:
    """2 (K and V) x layers x kv_heads x head_dim x bytes: what one more token of context costs. The one
    formula every pool size, memory plot and benchmark uses (a block holds block_size tokens).

    Grouped-query attention is why n_kv_heads and not n_heads appears here: SmolLM2's 9 query
    heads share 3 KV heads, so its cache is a third of what full multi-head attention would keep."""
    if dtype_bytes <= 0:
        raise ValueError(f"dtype_bytes must be positive, got {dtype_bytes}")
    return 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * dtype_bytes


def _positive_int(owner: str, name: str, v: object, minimum: int = 1) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise ValueError(f"{owner}.{name}={v!r} must be an int >= {minimum}")


MAX_BLOCK_SIZE = 256


@dataclass
class CacheConfig:
    """The paged KV pool: its block size, its size (bytes of RAM, or a block count), prefix caching."""

    block_size: int = 16  # token slots per block
    kv_cache_bytes: int = 1 << 30  # the pool's size (vLLM sizes it from free GPU memory; here a share of RAM)
    num_blocks: int | None = None  # if set, the pool's size in blocks of one KV cache group (kv_cache_bytes ignored)
    prefix_caching: bool = True  # full blocks are found by their tokens and shared across requests
    disable_hybrid_kv_cache_manager: bool = False  # True: one block table for all layers, sliding ones included

    def __post_init__(self) -> None:
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) \
                or not 1 <= self.block_size <= MAX_BLOCK_SIZE:
            raise ValueError(f"CacheConfig.block_size={self.block_size!r} must be an int in [1, {MAX_BLOCK_SIZE}]")
        _positive_int("CacheConfig", "kv_cache_bytes", self.kv_cache_bytes)
        if self.num_blocks is not None:
            _positive_int("CacheConfig", "num_blocks", self.num_blocks)

    def bytes_per_block(self, cfg: ModelConfig, dtype_bytes: int = 4, num_groups: int = 1) -> int:
        """A block's K and V: block_size tokens of the layers of one of num_groups KV cache groups (`kv.groups`)."""
        return kv_bytes_per_token(cfg, dtype_bytes) * self.block_size // num_groups

    def blocks_for(self, cfg: ModelConfig, dtype_bytes: int = 4, max_num_seqs: int | None = None,
                   num_groups: int = 1) -> int:
        """The pool's block count: `num_blocks` if set, else what kv_cache_bytes holds, at most enough for
        max_num_seqs full contexts in every one of num_groups KV cache groups (more could never be used)."""
        if self.num_blocks is not None:
            return self.num_blocks
        n = max(1, self.kv_cache_bytes // self.bytes_per_block(cfg, dtype_bytes, num_groups))
        if max_num_seqs is not None:
            n = min(n, max_num_seqs * num_groups * -(-cfg.max_position_embeddings // self.block_size))
        return n


@dataclass
class SchedulerConfig:
    """Who runs in a step, and how much of them (vLLM's names)."""

    max_num_seqs: int = 32  # sequences running at once
    max_num_batched_tokens: int = 512  # tokens one step computes: decode tokens and prompt chunks together
    chunked_prefill: bool = True  # a prompt larger than the budget left is split across steps
    num_scheduler_steps: int = 1  # forwards one step may run while every running request decodes greedily
    tpot_slo_ms: float | None = None  # while requests decode, steps sized to take at most this (`engine.step_cost`)

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "num_scheduler_steps"):
            _positive_int("SchedulerConfig", name, getattr(self, name))
        t = self.tpot_slo_ms
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < math.inf):
            raise ValueError(f"SchedulerConfig.tpot_slo_ms={t!r} must be a positive number of milliseconds, or None")


@dataclass
class SpeculativeConfig:
    """Speculative decoding in vLLM's shape: `method="ngram"` drafts by prompt lookup (the last
    prompt_lookup_max .. prompt_lookup_min tokens found earlier in the sequence propose what followed them)."""

    method: str = "ngram"
    num_speculative_tokens: int = 5
    prompt_lookup_max: int = 3
    prompt_lookup_min: int = 2

    def __post_init__(self) -> None:
        if self.method != "ngram":
            raise ValueError(f"SpeculativeConfig.method={self.method!r}: only 'ngram' (prompt lookup) is built")
        _positive_int("SpeculativeConfig", "num_speculative_tokens", self.num_speculative_tokens)
        _positive_int("SpeculativeConfig", "prompt_lookup_min", self.prompt_lookup_min)
        if isinstance(self.prompt_lookup_max, bool) or not isinstance(self.prompt_lookup_max, int) \
                or self.prompt_lookup_max < self.prompt_lookup_min:
            raise ValueError(f"SpeculativeConfig: need 1 <= prompt_lookup_min ({self.prompt_lookup_min}) <= "
                             f"prompt_lookup_max ({self.prompt_lookup_max!r})")

    @classmethod
    def of(cls, value: SpeculativeConfig | Mapping | None) -> SpeculativeConfig | None:
        """vLLM's `speculative_config` dict ({"method": "ngram", "num_speculative_tokens": k, ...}) or None."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, Mapping):
            raise ValueError(f"speculative_config must be a dict or None, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {unknown}; known: {sorted(known)}")
        return cls(**value)


@dataclass
class EngineConfig:
    """Everything an engine is built with, beside the model's own config: the cache, the scheduler,
    speculative decoding, and how steps run. One set of defaults for every road."""

    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig | None = None
    batch_invariant: bool = True  # a sequence's bits do not depend on what shares its steps
    compiled: bool | str | None = None  # the compiled kernels: None where they run, True insists, False never
    # ('ops': op by op under the Python forward, never the one-call step; `ModelRunner`)
    threads: int | str | None = None  # torch threads: a number, "auto" (the cores others leave free), None: as is
    history_kept: int = 4096  # step records kept (a long-running server must not grow without bound)
    finished_kept: int = 1024  # finished requests kept for reading after their last output

    # the flat keywords `LLM(...)`, `LLMEngine(...)` and `serve` take (vLLM's names), and where each lives
    KEYWORDS = {"block_size": "cache", "kv_cache_bytes": "cache", "num_blocks": "cache",
                "enable_prefix_caching": ("cache", "prefix_caching"), "disable_hybrid_kv_cache_manager": "cache",
                "max_num_seqs": "scheduler",
                "max_num_batched_tokens": "scheduler", "enable_chunked_prefill": ("scheduler", "chunked_prefill"),
                "num_scheduler_steps": "scheduler", "tpot_slo_ms": "scheduler",
                "speculative_config": "speculative", "batch_invariant": "", "compiled": "", "threads": ""}

    def __post_init__(self) -> None:
        self.speculative = SpeculativeConfig.of(self.speculative)
        if self.speculative is not None and self.scheduler.num_scheduler_steps > 1:
            raise ValueError("speculative decoding and num_scheduler_steps > 1 both run several tokens per step: "
                             "choose one")
        if self.threads is not None and self.threads != "auto":
            _positive_int("EngineConfig", "threads", self.threads)
        for name in ("history_kept", "finished_kept"):
            _positive_int("EngineConfig", name, getattr(self, name))

    @classmethod
    def from_kwargs(cls, **kwargs: object) -> EngineConfig:
        """An EngineConfig from vLLM's flat keywords: `EngineConfig.from_kwargs(max_num_seqs=8, block_size=32)`."""
        cache, sched, top = {}, {}, {}
        for key, value in kwargs.items():
            where = cls.KEYWORDS.get(key)
            if where is None:
                raise TypeError(f"unknown engine option {key!r}; known: {sorted(cls.KEYWORDS)}")
            section, name = where if isinstance(where, tuple) else (where, key)
            {"cache": cache, "scheduler": sched}.get(section, top)[name if section else key] = value
        if "speculative_config" in top:
            top["speculative"] = top.pop("speculative_config")
        return cls(cache=CacheConfig(**cache), scheduler=SchedulerConfig(**sched), **top)

    @staticmethod
    def add_cli_arguments(ap: argparse.ArgumentParser) -> None:
        """The engine's options on a command line, with the defaults above (`serve` and the benchmarks)."""
        c, s = CacheConfig(), SchedulerConfig()
        ap.add_argument("--max-num-seqs", type=int, default=s.max_num_seqs, help="sequences running at once")
        ap.add_argument("--max-num-batched-tokens", type=int, default=s.max_num_batched_tokens,
                        help="tokens one step computes (prompt chunks and decode tokens together)")
        ap.add_argument("--block-size", type=int, default=c.block_size, help="token slots per KV block")
        ap.add_argument("--kv-cache-gib", type=float, default=c.kv_cache_bytes / (1 << 30), help="the KV pool's size")
        ap.add_argument("--no-prefix-caching", action="store_true", help="never share full blocks across requests")
        ap.add_argument("--speculative-tokens", type=int, default=0,
                        help="prompt-lookup speculative decoding with this many draft tokens (0: off)")
        ap.add_argument("--num-scheduler-steps", type=int, default=s.num_scheduler_steps,
                        help="decode forwards one step runs while every running request decodes greedily")
        ap.add_argument("--tpot-slo-ms", type=float, default=s.tpot_slo_ms, metavar="MS",
                        help="while requests decode, size each step's prompt chunks from the measured step cost so "
                             "that a step takes at most MS (default: off, every step takes the full budget)")

    @classmethod
    def from_cli(cls, args: argparse.Namespace) -> EngineConfig:
        spec = {"method": "ngram", "num_speculative_tokens": args.speculative_tokens} \
            if getattr(args, "speculative_tokens", 0) else None
        return cls.from_kwargs(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                               block_size=args.block_size, kv_cache_bytes=int(args.kv_cache_gib * (1 << 30)),
                               enable_prefix_caching=not args.no_prefix_caching, speculative_config=spec,
                               num_scheduler_steps=getattr(args, "num_scheduler_steps", 1),
                               tpot_slo_ms=getattr(args, "tpot_slo_ms", None))
