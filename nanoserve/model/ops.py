"""The small operations of a decoder layer: RMSNorm, rotary positions, SwiGLU (Days 03, 04, 06).

Each is first written as its definition in torch (`rms_norm`, `apply_rope`), the form the
notebooks read and check against the reference library. The layer itself calls the step
forms (`add_rms_norm`, `rope_qk`, `silu_mul`): the same arithmetic, run by the compiled
kernels when the caller asks (`compiled=True`) and the tensors fit (fp32 on the CPU, no
gradients), and by exactly those torch definitions otherwise.

Shapes: B batch, T tokens, H query heads, K kv heads, D head_dim, C hidden, I intermediate.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import kernels
from ..config import ModelConfig


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x / rms(x) * weight, computed in fp32 like the reference (bf16 inputs are upcast first)."""
    if x.dtype == torch.float32:  # torch's rms_norm computes exactly this, bit for bit, in fewer ops
        return F.rms_norm(x, weight.shape, weight, eps)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def add_rms_norm(x: Tensor, residual: Tensor | None, weight: Tensor, eps: float, compiled: bool = False,
                 h_dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    """The residual stream's step: (x + residual, its rms_norm); with residual None, (x, rms_norm(x)).
    residual may be a bf16 product's output; h_dtype bf16 rounds the norm once for bf16 products (Day 42)."""
    if compiled and kernels.fits(x, weight) and (residual is None or kernels.fits(residual, bf16=True)):
        return kernels.add_rms_norm(x, residual, weight, eps, h_dtype)
    if residual is not None:
        x = x + residual
    return x, rms_norm(x, weight, eps).to(h_dtype)


def rope_frequencies(cfg: ModelConfig, theta: float | None = None) -> Tensor:
    """The D/2 rotation speeds theta^(-2i/D) (theta: cfg.rope_theta unless given), with llama3 frequency scaling
    when configured."""
    d = cfg.head_dim
    inv_freq = 1.0 / ((theta or cfg.rope_theta) ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
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


def rope_qk(qkv: Tensor, cos: Tensor, sin: Tensor, n_heads: int, n_kv_heads: int, compiled: bool = False,
            round_to: torch.dtype | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Split qkv (B, T, H + 2K, D) into q (B, T, H, D), k, v (B, T, K, D), with q and k rotated
    (one call for both); with `round_to` (a bf16 K/V cache's dtype) all three rounded to its numbers, in
    qkv's dtype. The compiled road rotates, and rounds to bf16, in qkv's own memory."""
    H, K = n_heads, n_kv_heads
    B, T, _, D = qkv.shape
    round_to = None if round_to == qkv.dtype else round_to
    if compiled and kernels.fits(qkv, cos, sin) and round_to in (None, torch.bfloat16):
        kernels.rope_(qkv.view(B * T, H + 2 * K, D), cos.reshape(B * T, D), sin.reshape(B * T, D), H + K,
                      round_bf16=round_to is not None)
        return qkv.split([H, K, K], dim=2)
    q, k = apply_rope(qkv[:, :, : H + K], cos, sin).split([H, K], dim=2)
    v = qkv[:, :, H + K:]
    if round_to is not None:
        q, k, v = (x.to(round_to).to(x.dtype) for x in (q, k, v))
    return q, k, v


def gelu_tanh_mul(gate_up: Tensor, compiled: bool = False) -> Tensor:
    """GeGLU's middle (Gemma): gate_up (..., 2I) fp32 -> gelu_tanh(gate) * up (..., I)."""
    if compiled and kernels.fits(gate_up):
        return kernels.gelu_tanh_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def silu_mul(gate_up: Tensor, compiled: bool = False) -> Tensor:
    """SwiGLU's middle: gate_up (..., 2I), the gate and up projections side by side -> silu(gate) * up (..., I),
    in gate_up's dtype."""
    if compiled and kernels.fits(gate_up, bf16=True):
        return kernels.silu_mul(gate_up)
    gate, up = gate_up.float().chunk(2, dim=-1)  # bf16 (a bf16 product's output): computed in fp32, rounded once
    return (F.silu(gate) * up).to(gate_up.dtype)
