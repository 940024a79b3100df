"""Attention over a paged pool: one metadata for every step (`metadata`), one backend (`backend`)
with three implementations: the reference gather (`reference`), batched torch ops (`torch_ops`),
and the compiled kernel (`kernels.paged_attention`). `online` is the online softmax the kernel's
split-K rests on: attention a block of keys at a time, equal to the full softmax."""

from .backend import IMPLEMENTATIONS, PagedAttention, choose
from .metadata import AttentionMetadata, Chunk, prepare

__all__ = ["IMPLEMENTATIONS", "AttentionMetadata", "Chunk", "PagedAttention", "choose", "prepare"]
