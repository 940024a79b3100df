"""The model: a Llama decoder (`llama`), its small operations (`ops`), its weight products
(`matmul`), reading a checkpoint folder (`weights`) and fetching the one the series uses (`fetch`)."""

from .llama import Block, KVBackend, Llama, causal_attention, no_cache_backend
from .matmul import linear, linear_weight
from .ops import add_rms_norm, apply_rope, rms_norm, rope_cos_sin, rope_frequencies, rope_qk, silu_mul
from .weights import load_model

__all__ = [
    "Block", "KVBackend", "Llama", "add_rms_norm", "apply_rope", "causal_attention", "linear", "linear_weight",
    "load_model", "no_cache_backend", "rms_norm", "rope_cos_sin", "rope_frequencies", "rope_qk", "silu_mul",
]
