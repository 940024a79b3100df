"""The paged attention backend: the KVBackend of every paged step, its implementations chosen here.

    reference  gather each request's blocks, attend over the copy (the oracle; Day 18)
    torch      batched torch ops: decode rows in one gathered rectangle (Day 28)
    compiled   one C++ loop that reads each request's keys where they lie (`kernels.paged_attention`;
               every query row computed as a decode row, a long one split into pieces over the cores);
               on a bf16 pool a whole prompt, whose keys are all new, takes the bf16 prompt kernel

All three take the same `AttentionMetadata` and give each request the same answer to fp32
rounding; each gives a request the same bits whatever else is in its step. The compiled one on an
fp32 pool also gives a prompt's rows the same bits however the prompt was cut into chunks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .. import kernels
from . import reference, torch_ops
from .causal import bf16_prompt_attention
from .metadata import AttentionMetadata

if TYPE_CHECKING:
    from ..kv.storage import KVStorage

Attend = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, AttentionMetadata, dict], Tensor]
"""(q (N, H, D), k, v (N, K, D), k_pool, v_pool (blocks, bs, K, D), metadata, scratch) -> (N, H*D)."""


def compiled_attend(q: Tensor, k: Tensor, v: Tensor, k_pool: Tensor, v_pool: Tensor, md: AttentionMetadata,
                    scratch: dict) -> Tensor:
    """Every row on the compiled kernel, reading keys where they lie: a row's bits depend on its keys alone,
    not on the step or on how its prompt was chunked. On a bf16 pool a whole prompt (nothing cached before
    it) has its keys in hand and takes the kernel with bf16 products (`bf16_prompt_attention`): faster, and
    its own numbers."""
    scale = q.shape[-1] ** -0.5
    if k_pool.dtype != torch.bfloat16:
        return kernels.paged_attention(q, k_pool, v_pool, md.query_start_loc, md.seq_lens, md.block_tables, scale)
    if "split" not in scratch:
        scratch["split"] = split_prompts(md)
    prompts, rest = scratch["split"]
    if not prompts:
        return kernels.paged_attention(q, k_pool, v_pool, md.query_start_loc, md.seq_lens, md.block_tables, scale)
    out = q.new_zeros(q.shape[0], q.shape[1] * q.shape[2])
    for s, e in prompts:
        out[s:e] = bf16_prompt_attention(q[s:e], k[s:e], v[s:e])
    if rest is not None:
        rows, qsl, seq_lens, tables = rest
        out[rows] = kernels.paged_attention(q[rows], k_pool, v_pool, qsl, seq_lens, tables, scale)
    return out


def split_prompts(md: AttentionMetadata) -> tuple[list[tuple[int, int]], tuple[Tensor, Tensor, Tensor, Tensor] | None]:
    """The step's whole prompts as row ranges, and the rest as the kernel's inputs: their rows of the
    step, and their query_start_loc, seq_lens and block tables (None if there is no rest)."""
    qsl = md.query_start_loc.tolist()
    whole = [r for r, (n, s) in enumerate(zip(md.query_lens, md.seq_lens_host)) if n > 1 and n == s]
    others = [r for r in range(md.num_requests) if r not in set(whole)]
    prompts = [(qsl[r], qsl[r + 1]) for r in whole]
    if not others:
        return prompts, None
    rows = torch.cat([torch.arange(qsl[r], qsl[r + 1]) for r in others])
    starts = torch.tensor([0] + [md.query_lens[r] for r in others]).cumsum(0)
    idx = torch.tensor(others)
    return prompts, (rows, starts, md.seq_lens[idx].contiguous(), md.block_tables[idx].contiguous())


IMPLEMENTATIONS: dict[str, Attend] = {
    "reference": reference.attend,
    "torch": torch_ops.attend,
    "compiled": compiled_attend,
}


def choose(kernels_on: bool, want: str | None = None) -> str:
    """The implementation a step runs: `want` if given, else the compiled one where the kernels are on."""
    if want is not None:
        if want not in IMPLEMENTATIONS:
            raise ValueError(f"attention={want!r}: choose one of {sorted(IMPLEMENTATIONS)}")
        if want == "compiled" and not kernels_on:
            raise ValueError("attention='compiled' needs the compiled kernels on (compiled=None, True or 'ops')")
        return want
    return "compiled" if kernels_on else "torch"


class PagedAttention:
    """The KVBackend of one paged step: write the step's new k/v into their slots, then attend.

    The model calls it once per layer with the rotated q (B, T, H, D) and k, v (B, T, K, D) of the
    step's tokens, laid out as `prepare` flattened them (B * T = N rows, padding rows last). On a pool of
    several KV cache groups, `group_metadata` holds each group's (its block tables and slots); a layer reads
    its own group's."""

    def __init__(self, storage: KVStorage, metadata: AttentionMetadata, impl: str = "reference",
                 group_metadata: list[AttentionMetadata] | None = None):
        self.storage, self.metadata, self.impl = storage, metadata, impl
        self.group_metadata = group_metadata or [metadata]
        self.attend = IMPLEMENTATIONS[impl]
        self.scratches: list[dict] = [{} for _ in self.group_metadata]  # what one layer builds, its group reuses
        self.scratch = self.scratches[0]

    supports_sliding_window = True  # a sliding layer's queries read their window's keys: the compiled kernel's
    # window where it runs (window <= SPLIT_KEYS), else `torch_ops.window_attend`

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor, window: int | None = None) -> Tensor:
        B, T, H, D = q.shape
        K = k.shape[2]
        q, k, v = q.reshape(B * T, H, D), k.reshape(B * T, K, D), v.reshape(B * T, K, D)
        g = self.storage.layer_group[layer]
        md, scratch = self.group_metadata[g], self.scratches[g]
        n = md.num_tokens  # real tokens come first: padding rows are never written
        self.storage.write(layer, md.slot_mapping, k[:n], v[:n])
        k_pool, v_pool = self.storage.layer(layer)
        if window is not None and self.impl == "compiled" and window <= kernels.SPLIT_KEYS:
            # the kernel reads each row's window where it lies (a bf16 pool's numbers widened, exactly)
            out = kernels.paged_attention(q, k_pool, v_pool, md.query_start_loc, md.seq_lens, md.block_tables,
                                          D ** -0.5, window=window).view(B * T, H * D)
        elif window is not None:
            out = torch_ops.window_attend(q, k_pool, v_pool, md, window, scratch)
        else:
            out = self.attend(q, k, v, k_pool, v_pool, md, scratch)
        return out.view(B, T, H * D)
