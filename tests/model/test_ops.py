"""The layer's small operations: their torch definitions, and the step forms that dispatch to the compiled
kernels when asked (`compiled=True`) and the tensors fit, and to exactly those definitions otherwise."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nanoserve import kernels
from nanoserve.model import add_rms_norm, apply_rope, rms_norm, rope_cos_sin, rope_qk, silu_mul


def rms_norm_written_out(x, weight, eps):
    h = x.double()
    return (weight.double() * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rotate_half(x):
    """transformers' rotate_half: (-x2, x1)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def test_rms_norm_is_its_definition():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 5, 64, generator=g) * 4, torch.rand(64, generator=g) + 0.5
    torch.testing.assert_close(rms_norm(x, w, 1e-5), rms_norm_written_out(x, w, 1e-5), atol=2e-6, rtol=1e-6)
    xb = x.bfloat16()
    out = rms_norm(xb, w.bfloat16(), 1e-5)  # bf16 in: computed in fp32, like the reference
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), rms_norm(xb.float(), w, 1e-5), atol=0.05, rtol=0.02)


def test_apply_rope_is_hf_rotate_half():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 7, 3, 16, generator=g)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, 16, 2).float() / 16)
    cos, sin = rope_cos_sin(inv_freq, torch.arange(7).expand(2, 7))
    torch.testing.assert_close(apply_rope(x, cos, sin), x * cos + rotate_half(x) * sin, atol=0, rtol=0)
    assert torch.equal(apply_rope(x, cos[:, :1] * 0 + 1, sin[:, :1] * 0), x)  # angle 0: unchanged


def step_inputs(seed=2, B=2, T=5, H=4, K=2, D=16, inter=24):
    g = torch.Generator().manual_seed(seed)
    x, r = torch.randn(B, T, 32, generator=g) * 3, torch.randn(B, T, 32, generator=g)
    w = torch.rand(32, generator=g) + 0.5
    qkv = torch.randn(B, T, H + 2 * K, D, generator=g)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, D, 2).float() / D)
    cos, sin = rope_cos_sin(inv_freq, torch.randint(0, 300, (B, T), generator=g))
    gate_up = torch.randn(B, T, 2 * inter, generator=g) * 3
    return x, r, w, qkv, cos, sin, gate_up


def test_on_torch_ops_the_step_forms_are_exactly_the_definitions():
    x, r, w, qkv, cos, sin, gate_up = step_inputs()
    H, K = 4, 2
    with torch.inference_mode():
        s, h = add_rms_norm(x, r, w, 1e-5, compiled=False)
        assert torch.equal(s, x + r) and torch.equal(h, rms_norm(x + r, w, 1e-5))
        s, h = add_rms_norm(x, None, w, 1e-5, compiled=False)
        assert s is x and torch.equal(h, rms_norm(x, w, 1e-5))
        q, k, v = rope_qk(qkv.clone(), cos, sin, H, K, compiled=False)
        qk = apply_rope(qkv[:, :, : H + K], cos, sin)
        assert torch.equal(q, qk[:, :, :H]) and torch.equal(k, qk[:, :, H:]) and torch.equal(v, qkv[:, :, H + K:])
        gate, up = gate_up.chunk(2, dim=-1)
        assert torch.equal(silu_mul(gate_up, compiled=False), F.silu(gate) * up)


def test_on_the_kernels_the_step_forms_agree_to_fp32_rounding(compiled):
    x, r, w, qkv, cos, sin, gate_up = step_inputs()
    H, K = 4, 2
    with torch.inference_mode():
        s, h = add_rms_norm(x, r, w, 1e-5, compiled=True)
        assert torch.equal(s, x + r)  # one fp32 add: exact
        torch.testing.assert_close(h, rms_norm(x + r, w, 1e-5), atol=2e-6, rtol=2e-6)
        mine = qkv.clone()
        q, k, v = rope_qk(mine, cos, sin, H, K, compiled=True)
        assert q.data_ptr() == mine.data_ptr()  # rotated in qkv's own memory
        qk = apply_rope(qkv[:, :, : H + K], cos, sin)
        torch.testing.assert_close(torch.cat([q, k], 2), qk, atol=1e-6, rtol=1e-6)
        assert torch.equal(v, qkv[:, :, H + K:])
        gate, up = gate_up.chunk(2, dim=-1)
        torch.testing.assert_close(silu_mul(gate_up, compiled=True), F.silu(gate) * up, atol=1e-6, rtol=2e-6)


def test_the_kernels_take_only_what_fits(compiled, monkeypatch):
    """fp32 (or bf16 from and for a bf16 product), contiguous, on the CPU, no gradient wanted: anything else runs the
    torch definition."""
    x, r, w, qkv, cos, sin, gate_up = step_inputs()

    def refuse(*args, **kwargs):
        raise AssertionError("a kernel was called on tensors it does not take")

    for name in ("add_rms_norm", "rope_", "silu_mul"):
        monkeypatch.setattr(kernels, name, refuse)
    with torch.inference_mode():
        assert not kernels.fits(x.double()) and not kernels.fits(x.transpose(0, 1))
        add_rms_norm(x.double(), None, w.double(), 1e-5, compiled=True)
        add_rms_norm(x.transpose(0, 1), None, w, 1e-5, compiled=True)
        silu_mul(gate_up.half(), compiled=True)
        add_rms_norm(x, r.half(), w, 1e-5, compiled=True)
        rope_qk(qkv, cos.transpose(0, 1).contiguous().transpose(0, 1), sin, 4, 2, compiled=True)  # a strided cos
        assert kernels.fits(x)
    with torch.enable_grad():
        assert not kernels.fits(x)  # gradients are on: the kernels have no backward
        add_rms_norm(x.requires_grad_(), None, w, 1e-5, compiled=True)
