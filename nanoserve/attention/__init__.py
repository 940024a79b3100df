"""Attention, in one folder: causal self-attention and the KV backend protocol (`causal`), one step's
metadata (`metadata`), the paged backend (`paged`) with its three implementations: the reference gather
(`reference`), batched torch ops (`torch_ops`) and the compiled kernel (`kernels.paged_attention`), and the
online softmax the kernel's split-K rests on (`online`): attention a block of keys at a time, equal to the
full softmax."""

from .causal import KVBackend, causal_attention, no_cache_backend
from .metadata import AttentionMetadata, Chunk, prepare
from .paged import IMPLEMENTATIONS, PagedAttention, choose

__all__ = ["IMPLEMENTATIONS", "AttentionMetadata", "Chunk", "KVBackend", "PagedAttention", "causal_attention", "choose",
           "no_cache_backend", "prepare"]
