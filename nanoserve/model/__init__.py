"""The model: a Llama decoder (`llama`), its small operations (`ops`), its weight products
(`matmul`), reading a checkpoint folder (`weights`), fetching the one the series uses (`fetch`), the
GGUF's own blocks (`gguf_weights`) and a model on them stepped by one compiled call (`compiled`)."""

from .llama import Block, Llama
from .matmul import linear, linear_weight
from .ops import add_rms_norm, apply_rope, rms_norm, rope_cos_sin, rope_frequencies, rope_qk, silu_mul
from .weights import load_model

__all__ = [
    "Block", "Llama", "add_rms_norm", "apply_rope", "linear", "linear_weight", "load_model", "rms_norm",
    "rope_cos_sin", "rope_frequencies", "rope_qk", "silu_mul",
]
