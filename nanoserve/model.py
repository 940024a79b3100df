"""The Llama decoder, written to be read (Days 03-07).

One forward pass: token ids -> embeddings -> n_layers x (RMSNorm, attention with
rotary positions and grouped-query heads, RMSNorm, SwiGLU MLP) -> RMSNorm -> logits.

Where the keys and values go is not this module's business. Attention calls a
*KV backend* with the rotated q, k, v of the current tokens; the backend writes
k and v wherever it keeps them (nowhere, a contiguous cache, a paged pool) and
returns the attention output. The model is the same on every engine path; only
the backend changes. `causal_attention` below is the no-cache backend.

Shapes: B batch, T new tokens, H query heads, K kv heads, D head_dim, C hidden.
"""

from __future__ import annotations

import functools
import math
import weakref
from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import handle_torch_function, has_torch_function

from .config import ModelConfig


class KVBackend(Protocol):
    """Where attention reads and writes K/V. Called once per layer per forward."""

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q (B, T, H, D), k/v (B, T, K, D), already rotated -> output (B, T, H*D)."""
        ...


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x / rms(x) * weight, computed in fp32 like the reference (bf16 inputs are upcast first)."""
    if x.dtype == torch.float32:  # torch's rms_norm computes exactly this, bit for bit, in fewer ops
        return F.rms_norm(x, weight.shape, weight, eps)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rope_frequencies(cfg: ModelConfig) -> Tensor:
    """The D/2 rotation speeds theta^(-2i/D), with llama3 frequency scaling when configured."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    rs = cfg.rope_scaling
    if rs and rs.get("rope_type", rs.get("type")) == "llama3":
        factor = rs["factor"]
        low, high = rs.get("low_freq_factor", 1.0), rs.get("high_freq_factor", 4.0)
        old_ctx = rs["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq


def rope_cos_sin(inv_freq: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
    """cos/sin tables for integer positions (B, T) -> each (B, T, 1, D)."""
    angles = positions.float()[..., None] * inv_freq  # (B, T, D/2)
    angles = torch.cat([angles, angles], dim=-1)  # (B, T, D): HF's rotate_half layout
    return angles.cos()[:, :, None, :], angles.sin()[:, :, None, :]


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate each pair (x_i, x_{i+D/2}) by its position's angle. x (B, T, heads, D)."""
    half = x.shape[-1] // 2
    rotated = x.roll(half, dims=-1)  # (x_{i+D/2}, x_i): the pairs swapped ...
    rotated[..., :half].neg_()  # ... and the first half negated: HF's rotate_half
    return x * cos + rotated * sin


def causal_attention(q: Tensor, k: Tensor, v: Tensor, key_mask: Tensor | None = None) -> Tensor:
    """Attention of T queries over the same T keys, causal, grouped-query.

    q (B, T, H, D), k/v (B, T, K, D); key_mask (B, T) bool marks real (not padding) keys.
    Returns (B, T, H*D).
    """
    B, T, H, D = q.shape
    qh = q.transpose(1, 2)  # (B, H, T, D)
    kh = k.transpose(1, 2)  # (B, K, T, D)
    vh = v.transpose(1, 2)
    mask = None
    if key_mask is not None:
        causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        mask = causal[None] & key_mask[:, None, :]  # (B, T, T)
        # a padding query would see no key at all; let it see itself so softmax stays finite
        mask = mask | torch.eye(T, dtype=torch.bool, device=q.device)[None]
        mask = mask[:, None]  # (B, 1, T, T)
    out = F.scaled_dot_product_attention(
        qh, kh, vh, attn_mask=mask, is_causal=mask is None, enable_gqa=True
    )  # (B, H, T, D)
    return out.transpose(1, 2).reshape(B, T, H * D)


def no_cache_backend(key_mask: Tensor | None = None) -> KVBackend:
    """The backend with no memory: each forward attends over exactly its own tokens."""
    return lambda layer, q, k, v: causal_attention(q, k, v, key_mask)


def linear_weight(out_features: int, in_features: int) -> nn.Parameter:
    """An (out, in) weight, as F.linear expects, laid out in memory as its transpose (in, out).

    Same shape, same values, different strides: `w.t()` is the contiguous tensor. At batch 1 a
    decode step is one matrix-vector product per weight, and this layout lets `linear` below read
    each weight as one front-to-back stream (Day 11 measures the candidates: `bench.layout_rates`).
    """
    return nn.Parameter(torch.empty(in_features, out_features).t())


BAG_ROWS = 16  # rows per partial sum in `linear`'s one-row road (at least): see its docstring
PARTIAL_SUMS = 1 << 19  # at most this many partial-sum floats (2 MB): only the LM head needs bigger bags


@functools.lru_cache(maxsize=32)
def _bags(n_in: int, n_out: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Row indices 0..n_in-1 and the offsets that cut them into bags. Made once per shape, outside
    inference mode so that autograd may save them when a caller records gradients."""
    rows_per_bag = max(BAG_ROWS, -(-n_in * n_out // PARTIAL_SUMS))
    with torch.inference_mode(False):
        return torch.arange(n_in, device=device), torch.arange(0, n_in, rows_per_bag, device=device)


def _has_onednn() -> bool:
    """Whether this torch build carries oneDNN's linear (x86 and most ARM builds do)."""
    try:
        return torch.backends.mkldnn.is_available() and all(
            hasattr(torch.ops.mkldnn, op) for op in ("_linear_pointwise", "_reorder_linear_weight"))
    except (AttributeError, RuntimeError):
        return False


ONEDNN = _has_onednn()


PACK_ROWS = 32
"""The row count oneDNN blocks a packed weight for; calls of any other count (2 or more) read it too."""

_PACKED: dict[int, tuple[weakref.ref, int, Tensor]] = {}
"""id(weight) -> (the weight, weakly; its version when packed; oneDNN's blocked copy). The entry
goes when the weight does. (Keyed by id: a tensor's == is elementwise, so it cannot be a key.)"""


def pack(w: Tensor, rows: int = PACK_ROWS) -> bool:
    """Keep a copy of w in oneDNN's blocked layout beside it, for `linear` to read; False where
    there is no oneDNN or w is not fp32 on the CPU. The copy costs w's bytes again. It is
    ignored once w is written (its version moves on), so it can never serve stale weights."""
    if not (ONEDNN and w.dtype == torch.float32 and w.device.type == "cpu" and w.dim() == 2) or w.is_inference():
        return False  # (an inference tensor keeps no version: a write to it could not be seen)
    with torch.inference_mode(False), torch.no_grad():
        blocked = torch.ops.mkldnn._reorder_linear_weight(w.detach(), rows)
    if id(w) not in _PACKED:
        weakref.finalize(w, _PACKED.pop, id(w), None)
    _PACKED[id(w)] = (weakref.ref(w), w._version, blocked)
    return True


def packed(w: Tensor) -> Tensor | None:
    """w's blocked copy, if it has a current one."""
    entry = _PACKED.get(id(w))
    return entry[2] if entry is not None and entry[0]() is w and entry[1] == w._version else None


def onednn_linear(x: Tensor, w: Tensor) -> Tensor:
    """x @ w.T through oneDNN's matrix product (torch's bundled mkldnn): on w's packed copy if it
    has one, else on w as it is stored.

    A torch.ops call is invisible to torch-function modes; routing it through this function
    lets tools that watch torch calls (the Day 12 profiler) see the product, and its weight."""
    if has_torch_function((x, w)):
        return handle_torch_function(onednn_linear, (x, w), x, w)
    wp = packed(w)
    return torch.ops.mkldnn._linear_pointwise(x, w if wp is None else wp, None, "none", [], "")


def _one_row_road() -> str:
    """How `linear` multiplies one row: "bag" (`bag_linear`) or "bmm" (`bmm_linear`). bmm where
    the CPU's best vector unit is AVX2, the bag elsewhere: see `linear` for what was measured."""
    try:
        capability = torch.backends.cpu.get_cpu_capability()
    except (AttributeError, RuntimeError):
        return "bag"
    return "bmm" if capability == "AVX2" else "bag"


ONE_ROW = _one_row_road()


def bag_linear(x: Tensor, w: Tensor) -> Tensor:
    """x @ w.T for ONE row x and a weight stored [in, out]: the weighted sum of w.T's rows,
    summed by F.embedding_bag in bags of BAG_ROWS (or more) and the bags' partial sums added."""
    n_out, n_in = w.shape
    rows, offsets = _bags(n_in, n_out, x.device)
    partial = F.embedding_bag(rows, w.t(), offsets, mode="sum", per_sample_weights=x.reshape(n_in))
    return partial.sum(0).view(*x.shape[:-1], n_out)  # partial: (bags, out)


BMM_ROWS = 32  # rows per slice in `bmm_linear` (it divides every matrix's in-features here: 576, 1536)


def bmm_linear(x: Tensor, w: Tensor) -> Tensor:
    """The same sum for ONE row x as `bag_linear`, as a batched matrix product: w.T's rows in slices of
    BMM_ROWS, each slice times its piece of x (one torch.bmm), then the slices' partial sums added.
    Needs in-features divisible by BMM_ROWS."""
    n_out, n_in = w.shape
    slices = n_in // BMM_ROWS
    partial = torch.bmm(x.reshape(slices, 1, BMM_ROWS), w.t().view(slices, BMM_ROWS, n_out))  # (slices, 1, out)
    return partial.sum(0).view(*x.shape[:-1], n_out)


def linear(x: Tensor, w: Tensor) -> Tensor:
    """x @ w.T for a weight w (out, in), like F.linear, on the fastest honest road for x's rows.

    Two or more rows (prefill, batched decode) are a matrix product. torch's F.linear hands it
    to MKL, which on an AMD CPU runs its AVX2 code; oneDNN, also inside torch, picks the kernel
    by what the CPU can do (AVX-512 here) and is about twice as fast on these shapes (Day 29
    measures both). It reads the [in, out] weight as stored, or faster still a copy `pack` made
    in its own blocked layout (`load_model` packs every matrix). Its rows are bit-identical
    whatever else is in a call of two or more rows, which batching relies on. It has no
    backward, so with gradients on, or on a build without it, F.linear does the work.

    One row (a batch-1 decode step) is a matrix-vector product: 2 FLOPs per 4-byte weight, so
    its speed is how fast w streams from memory. On a weight stored [in, out] (`linear_weight`),
    x @ w.T = sum_i x[i] * w.T[i], a weighted sum of contiguous rows, which is exactly what
    F.embedding_bag computes (mode="sum", per_sample_weights=x); its kernel streams faster than
    either library's product on that layout (Day 11 measures them all). A packed copy would be
    about 10% faster still, but the bag rounds about 4x less per product (measured against fp64
    on the model's matrices), and batch 1 is where logits are held to the reference within 1e-4:
    so one row keeps this road. The rows are summed in bags of BAG_ROWS and the partial sums
    added at the end: one long running sum rounds more than BLAS's blocked one (2e-4 off an fp64
    forward in the logits, where transformers' fp32 is 1e-4 off); in bags of 16 it is 5e-5 off,
    the best of the sizes tried (16 to 128). Bags grow only where the partial sums would pass
    PARTIAL_SUMS (the LM head: 54 rows).

    All of that was measured on an AVX-512 CPU (AMD Zen 4/5). On an AVX2 one (Zen 3) the bag's
    kernel is the slow road: 13-20 GB/s. There the same partial sums go faster as one batched
    product, `bmm_linear` (MKL's torch.bmm of BMM_ROWS-row slices: the LM head in 4.0 ms instead
    of the bag's 6.8), and round as little: 1.1-2.0e-5 off fp64 per product on unit-normal
    matrices of the model's shapes, the bag 0.8-1.9e-5; oneDNN's plain product, as fast, is
    3.5e-5-1.1e-4 off and put the one-token prompt's logits 1.6e-4 from the reference. So
    `ONE_ROW` picks by the CPU: bmm on AVX2, the bag elsewhere (`bench layout` times the roads
    on the machine at hand).
    """
    n_out, n_in = w.shape
    if x.dtype == w.dtype == torch.float32 and x.device.type == "cpu" and w.stride() == (1, n_out):
        if x.numel() == n_in:
            if ONE_ROW == "bmm" and n_in % BMM_ROWS == 0:
                return bmm_linear(x, w)
            return bag_linear(x, w)
        if ONEDNN and not torch.is_grad_enabled():
            return onednn_linear(x, w)
    return F.linear(x, w)


class Block(nn.Module):
    """One decoder layer. q/k/v and gate/up are each one fused matrix: one read of the weights."""

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

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, layer: int, kv: KVBackend) -> Tensor:
        cfg = self.cfg
        B, T, _ = x.shape
        H, K, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        h = rms_norm(x, self.attn_norm, cfg.rms_norm_eps)
        qkv = linear(h, self.wqkv).view(B, T, H + 2 * K, D)  # every head's q, k, v side by side
        qk = apply_rope(qkv[:, :, : H + K], cos, sin)  # the q and k heads, rotated in one call
        q, k = qk.split([H, K], dim=2)  # (B, T, H, D), (B, T, K, D)
        v = qkv[:, :, H + K :]  # (B, T, K, D)
        x = x + linear(kv(layer, q, k, v), self.wo)
        h = rms_norm(x, self.mlp_norm, cfg.rms_norm_eps)
        gate, up = linear(h, self.w_gate_up).chunk(2, dim=-1)  # SwiGLU
        return x + linear(F.silu(gate) * up, self.w_down)


LayerFn = Callable[[Block, Tensor, Tensor, Tensor, int, KVBackend], Tensor]
"""Runs one decoder layer: (block, x, cos, sin, layer, kv) -> x, as `Block.forward` does."""


class Llama(nn.Module):
    """Token ids and their positions in, next-token logits out."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        V, C = cfg.vocab_size, cfg.hidden_size
        # Tied: one (V, C) matrix is both the embedding table and the LM head. It is stored for the
        # head, [in, out] like every other linear weight: the head streams 113 MB per decoded token,
        # while an embedding lookup reads one row per token, strided or not.
        self.embed = linear_weight(V, C) if cfg.tie_word_embeddings else nn.Parameter(torch.empty(V, C))
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.Parameter(torch.ones(C))
        self.lm_head = self.embed if cfg.tie_word_embeddings else linear_weight(V, C)
        self.register_buffer("inv_freq", rope_frequencies(cfg), persistent=False)
        self._rope_table: tuple[Tensor, Tensor] | None = None  # cos, sin (P, D), grown on demand

    def rope(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos/sin (B, T, 1, D) for integer positions, looked up in a table computed once.

        The table holds exactly what `rope_cos_sin` computes, so cached and uncached paths agree
        bit for bit; it grows (doubling) when a position beyond it is asked for.
        """
        lo, hi = (int(p) for p in torch.aminmax(positions))
        if lo < 0:  # not a table index: compute directly
            cos, sin = rope_cos_sin(self.inv_freq, positions)
            return cos.to(self.dtype), sin.to(self.dtype)
        table = self._rope_table
        if table is None or table[0].shape[0] <= hi or table[0].dtype != self.dtype \
                or table[0].device != positions.device:
            size = max(256, 1 << hi.bit_length())
            cos, sin = rope_cos_sin(self.inv_freq, torch.arange(size, device=positions.device)[None])
            table = self._rope_table = (cos[0, :, 0].to(self.dtype), sin[0, :, 0].to(self.dtype))  # (P, D)
        return table[0][positions][:, :, None], table[1][positions][:, :, None]

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    def hidden_states(
        self, ids: Tensor, positions: Tensor | None = None, kv: KVBackend | None = None,
        on_layer: Callable[[int, Tensor], None] | None = None, layer_fn: LayerFn | None = None,
    ) -> Tensor:
        """ids (B, T) -> final normed hidden states (B, T, C). `on_layer(i, x)` sees the residual stream.
        `layer_fn(block, x, cos, sin, i, kv)` runs each layer in place of the block itself (Day 29's
        `kernels.fused_layer`: the same layer with its small calls compiled)."""
        if ids.dim() == 1:
            ids = ids[None]
        B, T = ids.shape
        if positions is None:
            positions = torch.arange(T, device=ids.device).expand(B, T)
        kv = kv or no_cache_backend()
        cos, sin = self.rope(positions)  # (B, T, 1, D) each, in the model's dtype
        x = F.embedding(ids, self.embed)  # (B, T, C)
        for i, block in enumerate(self.layers):
            x = block(x, cos, sin, i, kv) if layer_fn is None else layer_fn(block, x, cos, sin, i, kv)
            if on_layer is not None:
                on_layer(i, x)
        return rms_norm(x, self.norm, self.cfg.rms_norm_eps)

    def forward(
        self, ids: Tensor, positions: Tensor | None = None, kv: KVBackend | None = None,
        last_only: bool = False, logit_index: Tensor | None = None,
    ) -> Tensor:
        """Logits (B, T, V); with `last_only` just the last position (B, V); with `logit_index` (B,)
        the position each row wants (B, V). Computing only the needed rows skips most of the LM head."""
        h = self.hidden_states(ids, positions, kv)
        if logit_index is not None:
            h = h[torch.arange(h.shape[0], device=h.device), logit_index]
        elif last_only:
            h = h[:, -1]
        return linear(h, self.lm_head).float()

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

    def pack_weights(self, rows: int = PACK_ROWS) -> int:
        """Give every matrix a oneDNN-blocked copy (`pack`): faster products of two or more rows (prefill,
        batches), for the memory of the weights once more. Returns the bytes added (0 without oneDNN)."""
        mats = {id(w): w for blk in self.layers for w in (blk.wqkv, blk.wo, blk.w_gate_up, blk.w_down)}
        mats[id(self.lm_head)] = self.lm_head
        return sum(w.numel() * w.element_size() for w in mats.values() if pack(w, rows))

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())  # tied weights are counted once

    def weight_bytes(self) -> int:
        """Bytes a decode step must stream: every parameter once (tied embeddings once, no copies).

        Exact for tied models (the head reads the whole table, the lookup one row of it); an untied
        model's input table is counted too, although a step reads only one row of it.
        """
        return sum(p.numel() * p.element_size() for p in self.parameters())
