"""The Llama decoder, written to be read (Days 03-07).

One forward pass: token ids -> embeddings -> n_layers x (RMSNorm, attention with
rotary positions and grouped-query heads, RMSNorm, SwiGLU MLP) -> RMSNorm -> logits.

Where the keys and values go is not this module's business. Attention calls a
*KV backend* (`attention.causal`) with the rotated q, k, v of the current tokens; the
backend writes k and v wherever it keeps them (nowhere, a contiguous cache, a paged
pool) and returns the attention output. The model is the same on every engine path;
only the backend changes. With no backend given, a forward attends over its own tokens.

The layer's small operations live in `ops`, the weight products in `matmul`. Whether
they run the compiled kernels is the caller's choice, one argument (`compiled`) passed
down the forward.

Shapes: B batch, T new tokens, H query heads, K kv heads, D head_dim, C hidden.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import kernels
from ..attention.causal import KVBackend, no_cache_backend
from ..config import ModelConfig
from .base import DecoderLM
from .matmul import embedding, forward_rows, linear, linear_weight
from .ops import add_rms_norm, rope_frequencies, rope_qk, silu_mul


class Block(nn.Module):
    """One decoder layer: two residual sublayers, attention then the MLP, each reading the normed stream.
    q/k/v and gate/up are each one fused matrix: one read of the weights."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        C, D = cfg.hidden_size, cfg.head_dim
        self.attn_norm = nn.Parameter(torch.ones(C))
        self.wqkv = linear_weight((cfg.n_heads + 2 * cfg.n_kv_heads) * D, C)  # (out, in)
        self.wo = linear_weight(C, cfg.n_heads * D)
        self.mlp_norm = nn.Parameter(torch.ones(C))
        self.w_gate_up = linear_weight(2 * cfg.intermediate_size, C)
        self.w_down = linear_weight(C, cfg.intermediate_size)
        self.kv_dtype: torch.dtype | None = None  # K/V rounded to this before attention (None: kept as computed)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, layer: int, kv: KVBackend, compiled: bool = False) -> Tensor:
        """x (B, T, C) -> (B, T, C): x + attention(norm(x)), then that + mlp(norm(that))."""
        eps, hd = self.cfg.rms_norm_eps, self.product_dtype
        x, h = add_rms_norm(x, None, self.attn_norm, eps, compiled, hd)
        x, h = add_rms_norm(x, self.attention(h, cos, sin, layer, kv, compiled), self.mlp_norm, eps, compiled, hd)
        return x + self.mlp(h, compiled)  # (a bf16 product's output widened by the add)

    @property
    def product_dtype(self) -> torch.dtype:
        """What the block's products take and give: bf16 for bf16 matrices (Day 42), else fp32."""
        return torch.bfloat16 if self.wqkv.dtype == torch.bfloat16 else torch.float32

    def attention(self, h: Tensor, cos: Tensor, sin: Tensor, layer: int, kv: KVBackend,
                  compiled: bool = False) -> Tensor:
        """What attention adds to the stream: q, k, v from one product, RoPE on q and k, the
        backend's attention, the output projection. h (B, T, C) normed; cos/sin (B, T, 1, D)."""
        cfg = self.cfg
        B, T, _ = h.shape
        H, K, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        qkv = linear(h, self.wqkv, compiled).to(self.attn_norm.dtype)  # in the stream's dtype (bf16 matrices: fp32)
        qkv = qkv.view(B, T, H + 2 * K, D)  # every head's q, k, v side by side
        # (B, T, H, D), (B, T, K, D), (B, T, K, D); with a bf16 cache, its numbers, q's too, on every road
        q, k, v = rope_qk(qkv, cos, sin, H, K, compiled, self.kv_dtype)
        return linear(kv(layer, q, k, v).view(B, T, H * D), self.wo, compiled)

    def mlp(self, h: Tensor, compiled: bool = False) -> Tensor:
        """What the MLP adds: SwiGLU, silu(gate) * up from one product, projected back down. h (B, T, C)."""
        return linear(silu_mul(linear(h, self.w_gate_up, compiled), compiled), self.w_down, compiled)


class Llama(DecoderLM):
    """Token ids and their positions in, next-token logits out."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        V, C = cfg.vocab_size, cfg.hidden_size
        # Tied: one (V, C) matrix is both the embedding table and the LM head. It is stored for the
        # head, [in, out] like every other linear weight: the head streams all of it per decoded
        # token, while an embedding lookup reads one row per token, strided or not.
        self.embed = linear_weight(V, C) if cfg.tie_word_embeddings else nn.Parameter(torch.empty(V, C))
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.Parameter(torch.ones(C))
        self.lm_head = self.embed if cfg.tie_word_embeddings else linear_weight(V, C)
        self.register_buffer("inv_freq", rope_frequencies(cfg), persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the forward computes in (a model on GGUF blocks computes in fp32)."""
        return self.norm.dtype

    def hidden_states(
        self, ids: Tensor, positions: Tensor | None = None, kv: KVBackend | None = None,
        on_layer: Callable[[int, Tensor], None] | None = None, compiled: bool | None = None,
    ) -> Tensor:
        """ids (B, T) -> final normed hidden states (B, T, C). `on_layer(i, x)` sees the residual stream.
        `compiled`: run the compiled kernels (None: wherever they are built)."""
        compiled = kernels.resolve(compiled)
        if ids.dim() == 1:
            ids = ids[None]
        B, T = ids.shape
        if positions is None:
            positions = torch.arange(T, device=ids.device).expand(B, T)
        kv = kv or no_cache_backend(bf16=compiled and self.kv_dtype == torch.bfloat16)
        cos, sin = self.rope(positions)  # (B, T, 1, D) each, in the model's dtype
        x = embedding(ids, self.embed, self.dtype)  # (B, T, C)
        for i, block in enumerate(self.layers):
            x = block(x, cos, sin, i, kv, compiled)
            if on_layer is not None:
                on_layer(i, x)
        return add_rms_norm(x, None, self.norm, self.cfg.rms_norm_eps, compiled)[1]

    def logits(self, h: Tensor, compiled: bool | None = None) -> Tensor:
        """The LM head: final hidden states h (..., C) -> fp32 logits (..., V). Two or more rows run
        as forward_rows(n) (zero rows added): one product kernel for every row, whatever the count."""
        rows = h.reshape(-1, h.shape[-1])  # (n, C)
        n = rows.shape[0]
        rows = F.pad(rows, (0, 0, 0, forward_rows(n) - n))
        return linear(rows, self.lm_head, kernels.resolve(compiled))[:n].float().view(*h.shape[:-1], -1)

    def forward(
        self, ids: Tensor, positions: Tensor | None = None, kv: KVBackend | None = None,
        last_only: bool = False, logit_index: Tensor | None = None, compiled: bool | None = None,
    ) -> Tensor:
        """Logits (B, T, V); with `last_only` just the last position (B, V); with `logit_index` (B,)
        the position each row wants (B, V). Computing only the needed rows skips most of the LM head."""
        compiled = kernels.resolve(compiled)
        h = self.hidden_states(ids, positions, kv, compiled=compiled)
        if logit_index is not None:
            h = h[torch.arange(h.shape[0], device=h.device), logit_index]
        elif last_only:
            h = h[:, -1]
        return self.logits(h, compiled)

    @classmethod
    def random(cls, cfg: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float32) -> Llama:
        """Random weights with sensible scale: for unit tests and shape experiments."""
        g = torch.Generator().manual_seed(seed)
        model = cls(cfg)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
                else:
                    p.copy_(torch.randn(p.shape, generator=g) * (1.0 / math.sqrt(p.shape[-1])))
        return model.to(dtype).eval()
