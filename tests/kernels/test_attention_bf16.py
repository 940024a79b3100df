"""The bf16 prompt-attention kernel (csrc/attention_bf16.cpp) against torch's causal attention on the same bf16
inputs: within the rounding of its softmax weights to bf16, causal, the same bits for a row whatever follows it,
and clear refusals. The model and engine around it are checked in tests/test_numerics.py."""

import pytest
import torch

from nanoserve import kernels
from nanoserve.attention.causal import bf16_prompt_attention, causal_attention

pytestmark = pytest.mark.skipif(not kernels.prompt_attention_bf16_here(64),
                                reason="no AVX512_BF16 (or no kernels) here: bf16_prompt_attention takes torch's road")


def qkv(T: int, H: int, K: int, D: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v as the model hands them over: views of one (T, H + 2K, D) product, rounded to bf16 values."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(T, H + 2 * K, D, generator=g) * 2).bfloat16().float()
    return x[:, :H], x[:, H:H + K], x[:, H + K:]


@pytest.mark.parametrize("T", [1, 2, 7, 8, 9, 16, 17, 63, 64, 65, 130, 300])
@pytest.mark.parametrize("H,K,D", [(9, 3, 64), (4, 4, 64), (4, 2, 128)])
def test_within_the_rounding_of_its_weights_of_torch_causal_attention(T, H, K, D):
    """Each weight rounded to bf16 moves by at most 2^-9 of itself, the same weights divide the sum: every output
    stays within 2^-8 of the largest |v| of torch's fp32 attention over the same bf16 q, k, v."""
    q, k, v = qkv(T, H, K, D)
    out = kernels.prompt_attention_bf16(q, k, v, D ** -0.5)
    want = causal_attention(q[None], k[None], v[None], 0)[0]
    assert out.shape == (T, H * D)
    assert float((out - want).abs().max()) <= 2 ** -8 * float(v.abs().max()) + 1e-5


def test_a_row_sees_no_later_key_and_has_the_same_bits_whatever_follows():
    q, k, v = qkv(150, 9, 3, 64)
    full = kernels.prompt_attention_bf16(q, k, v, 0.125)
    for t in (1, 8, 64, 77, 149):
        assert torch.equal(kernels.prompt_attention_bf16(q[:t], k[:t], v[:t], 0.125), full[:t]), t
    k2, v2 = k.clone(), v.clone()
    k2[100:], v2[100:] = 50.0, -50.0
    assert torch.equal(kernels.prompt_attention_bf16(q, k2, v2, 0.125)[:100], full[:100])


def test_bf16_prompt_attention_takes_the_kernel_where_it_runs():
    q, k, v = qkv(40, 9, 3, 64)
    with torch.inference_mode():
        assert torch.equal(bf16_prompt_attention(q, k, v), kernels.prompt_attention_bf16(q, k, v, 0.125))
    q16, k16, v16 = qkv(40, 4, 2, 16)  # a head size the kernel is not built for: torch's road
    with torch.inference_mode():
        assert torch.equal(bf16_prompt_attention(q16, k16, v16), causal_attention(q16[None], k16[None], v16[None])[0])


def test_refuses_what_it_cannot_take():
    q, k, v = qkv(8, 4, 2, 64)
    with pytest.raises(RuntimeError, match="head_dim 32: this kernel takes 64 or 128"):
        kernels.prompt_attention_bf16(q[..., :32], k[..., :32], v[..., :32], 0.125)
    with pytest.raises(RuntimeError, match="with K dividing 4 query heads"):
        kernels.prompt_attention_bf16(q, torch.cat([k, k[:, :1]], 1), torch.cat([v, v[:, :1]], 1), 0.125)
    with pytest.raises(RuntimeError, match="q: expected a float32 CPU tensor"):
        kernels.prompt_attention_bf16(q.bfloat16(), k, v, 0.125)
