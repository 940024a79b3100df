"""The Llama decoder against the reference: tiny random configs (fast), the one layer body on both
roads of its small ops, and the real checkpoint against transformers' fp64 forward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers
from prompts import PROMPTS, prompt_ids

from nanoserve import kernels
from nanoserve.attention.causal import no_cache_backend
from nanoserve.config import ModelConfig
from nanoserve.model import Llama, apply_rope, linear, rms_norm, rope_cos_sin
from nanoserve.model.matmul import forward_rows
from nanoserve.model.weights import load_model, save_checkpoint


def _hf_from(model: Llama, folder):
    save_checkpoint(model, folder)
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"n_kv_heads": 4},  # plain multi-head attention
        {"n_kv_heads": 1},  # multi-query
        {"tie_word_embeddings": False},
        {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}},
    ],
    ids=["gqa", "mha", "mqa", "untied", "llama3-rope"],
)
def test_tiny_logits_match_transformers(tmp_path, overrides, road):
    cfg = ModelConfig.tiny(max_position_embeddings=256, **overrides)
    ours = Llama.random(cfg, seed=1)
    ref = _hf_from(ours, tmp_path)
    ids = torch.randint(0, cfg.vocab_size, (2, 150), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        a, b = ours(ids, compiled=road == "compiled"), ref(ids).logits
    assert (a - b).abs().max().item() < 1e-4


def test_save_load_round_trip(tmp_path, tiny_model):
    save_checkpoint(tiny_model, tmp_path)
    again = load_model(tmp_path)
    for (n1, p1), (n2, p2) in zip(tiny_model.named_parameters(), again.named_parameters()):
        assert n1 == n2 and torch.equal(p1, p2)


def test_bf16_runs_and_tracks_fp32(tiny_model):
    ids = torch.arange(20)[None] % tiny_model.cfg.vocab_size
    with torch.no_grad():
        a = tiny_model(ids)
        b = Llama.random(tiny_model.cfg, seed=0, dtype=torch.bfloat16)(ids)
    assert b.dtype == torch.float32  # logits always come back fp32
    assert (a.softmax(-1) - b.softmax(-1)).abs().max() < 0.05


def test_rope_table_is_exactly_the_direct_computation(tiny_model):
    """Cached and uncached paths read cos/sin from the table: it must hold rope_cos_sin's bits,
    also after it grows past its first size, and negative positions are computed directly."""
    pos = torch.tensor([[0, 5, 255, 256, 700], [3, 3, 1, 0, 511]])
    cos, sin = tiny_model.rope(pos)
    want_cos, want_sin = rope_cos_sin(tiny_model.inv_freq, pos)
    assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
    neg = torch.tensor([[-2, 4]])
    assert torch.equal(tiny_model.rope(neg)[0], rope_cos_sin(tiny_model.inv_freq, neg)[0])


def test_hidden_states_shows_every_layer_and_forward_picks_rows(tiny_model):
    ids = torch.tensor([[5, 9, 200, 3], [7, 7, 1, 42]])
    seen = []
    with torch.inference_mode():
        h = tiny_model.hidden_states(ids, on_layer=lambda i, x: seen.append((i, tuple(x.shape))))
        every = tiny_model(ids)  # (B, T, V)
        last = tiny_model(ids, last_only=True)  # (B, V)
        picked = tiny_model(ids, logit_index=torch.tensor([1, 3]))
    assert seen == [(i, (2, 4, tiny_model.cfg.hidden_size)) for i in range(tiny_model.cfg.n_layers)]
    assert h.shape == (2, 4, tiny_model.cfg.hidden_size)
    V = tiny_model.cfg.vocab_size
    assert every.shape == (2, 4, V) and last.shape == picked.shape == (2, V)
    # two rows through the head: the same product kernel as four (forward_rows), so the same bits
    assert torch.equal(last, every[:, -1]) and torch.equal(picked[0], every[0, 1])


def test_lm_head_rows_do_not_depend_on_how_many_rows_there_are(tiny_model):
    """Llama.logits runs n >= 2 rows as forward_rows(n): a row's logits are the same bits in any call."""
    g = torch.Generator().manual_seed(5)
    h = torch.randn(13, tiny_model.cfg.hidden_size, generator=g)
    with torch.inference_mode():
        full = tiny_model.logits(h)
        for n in range(2, 13):
            assert torch.equal(tiny_model.logits(h[:n]), full[:n]), n
        one = tiny_model.logits(h[:1])  # one row alone: its own road, the same numbers to fp32 rounding
    torch.testing.assert_close(one, full[:1], atol=1e-5, rtol=0)
    assert [forward_rows(n) for n in (1, 2, 3, 4, 5, 8, 9, 32)] == [1, 4, 4, 4, 8, 8, 12, 32]


# ---- the one layer body: Block.forward = attention and mlp, on either road of the small ops ----------


def old_block_forward(block, x, cos, sin, layer, kv):
    """The layer as it was written before the compiled glue: x + attention, rms_norm, SwiGLU, all torch."""
    cfg = block.cfg
    B, T, _ = x.shape
    H, K, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    h = rms_norm(x, block.attn_norm, cfg.rms_norm_eps)
    qkv = linear(h, block.wqkv).view(B, T, H + 2 * K, D)
    q, k = apply_rope(qkv[:, :, : H + K], cos, sin).split([H, K], dim=2)
    v = qkv[:, :, H + K:]
    x = x + linear(kv(layer, q, k, v), block.wo)
    h = rms_norm(x, block.mlp_norm, cfg.rms_norm_eps)
    gate, up = linear(h, block.w_gate_up).chunk(2, dim=-1)
    return x + linear(F.silu(gate) * up, block.w_down)


def block_inputs(model: Llama, B: int = 2, T: int = 9, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, model.cfg.hidden_size, generator=g) * 2
    cos, sin = model.rope(torch.arange(T).expand(B, T))
    return x, cos, sin


@pytest.mark.parametrize("B, T", [(2, 9), (1, 1)])
def test_block_forward_on_torch_ops_is_the_old_formulation_bit_for_bit(tiny_model, B, T):
    x, cos, sin = block_inputs(tiny_model, B, T)
    kv = no_cache_backend()
    with torch.inference_mode():
        for i, block in enumerate(tiny_model.layers):
            fast = block(x, cos, sin, i, kv, compiled=False)
            assert torch.equal(fast, old_block_forward(block, x, cos, sin, i, kv)), i


# A layer on the compiled glue against the same layer on torch's ops: the same products, the small ops
# (norms, RoPE, silu) rounded in another order. The tiny model's layer outputs are of order 1-10.
BLOCK_KERNEL_TOL = 8e-6


@pytest.mark.parametrize("B, T", [(2, 9), (1, 1)])
def test_block_forward_on_the_kernels_is_the_old_formulation_to_fp32_rounding(tiny_model, compiled, B, T):
    x, cos, sin = block_inputs(tiny_model, B, T)
    kv = no_cache_backend()
    with torch.inference_mode():
        for i, block in enumerate(tiny_model.layers):
            fast = block(x, cos, sin, i, kv, compiled=True)
            ref = old_block_forward(block, x, cos, sin, i, kv)
            err = (fast - ref).abs().max().item()
            assert err < BLOCK_KERNEL_TOL, f"layer {i}: {err:.2e}"


def test_compiled_false_really_turns_the_kernels_off(tiny_model, compiled, monkeypatch):
    """With compiled=False no kernel is called; with compiled=True (or None, where they are built) they are."""
    calls = []

    def spy(name):
        real = getattr(kernels, name)

        def wrapped(*args, **kwargs):
            calls.append(name)
            return real(*args, **kwargs)

        return wrapped

    for name in ("add_rms_norm", "rope_", "silu_mul"):
        monkeypatch.setattr(kernels, name, spy(name))
    ids = torch.tensor([[5, 9, 200, 3]])
    with torch.inference_mode():
        off = tiny_model(ids, compiled=False)
        assert calls == []
        on = tiny_model(ids, compiled=True)
        assert {"add_rms_norm", "rope_", "silu_mul"} <= set(calls)
        calls.clear()
        assert torch.equal(tiny_model(ids), on) and calls  # None: the kernels, where they are built
    torch.testing.assert_close(on, off, atol=1e-4, rtol=0)


def test_gradients_take_the_torch_road(tiny_cfg, compiled):
    """With gradients on, the kernels (no backward) are never used: the forward is differentiable."""
    model = Llama.random(tiny_cfg, seed=2)
    model.train()
    logits = model(torch.tensor([[1, 2, 3]]))
    logits.sum().backward()
    assert all(p.grad is not None for p in model.parameters())


# ---- the real checkpoint ------------------------------------------------------------------------------


def test_real_model_shape_and_parameter_count(model):
    cfg = model.cfg
    assert (cfg.n_layers, cfg.hidden_size, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == (30, 576, 9, 3, 64)
    assert cfg.vocab_size == 49152 and cfg.tie_word_embeddings and cfg.rope_theta == 100000.0
    assert model.num_parameters() == 134_515_008




def test_parity_prompts_span_1_to_500_tokens(tok):
    assert sorted(len(prompt_ids(tok, n)) for n in PROMPTS) == [1, 5, 7, 37, 43, 500]


@pytest.mark.parametrize("name", PROMPTS)
def test_real_logits_match_the_fp64_reference(model, tok, fp64_logits, fp64_tol, name, road):
    """Every position's logits, and the last position's through the one-row head generation uses,
    within the stated bounds of transformers' fp64 forward, on both roads of the small ops."""
    last_tol, any_tol = fp64_tol
    ids = prompt_ids(tok, name)
    exact = fp64_logits(ids)  # (T, V)
    with torch.inference_mode():
        every = model(torch.tensor([ids]), compiled=road == "compiled")[0].double()  # (T, V): the head on every row
        last = model(torch.tensor([ids]), last_only=True, compiled=road == "compiled")[0].double()  # (V,): one row
    assert (last - exact[-1]).abs().max().item() < last_tol
    assert (every[-1] - exact[-1]).abs().max().item() < last_tol
    assert (every - exact).abs().max().item() < any_tol


@pytest.mark.parametrize("name", PROMPTS)
def test_transformers_fp32_is_inside_the_same_bounds(hf_model, tok, fp64_logits, fp64_tol, name):
    """The bounds are about fp32 rounding, not about us: the reference's own fp32 forward meets them too."""
    last_tol, any_tol = fp64_tol
    ids = prompt_ids(tok, name)
    with torch.inference_mode():
        theirs = hf_model(torch.tensor([ids])).logits[0].double()
    exact = fp64_logits(ids)
    assert (theirs[-1] - exact[-1]).abs().max().item() < last_tol
    assert (theirs - exact).abs().max().item() < any_tol


def test_the_bounds_catch_a_subtle_bug(model, tok, fp64_logits, fp64_tol):
    """A norm eps off by 10x is a bug the bound must see: it moves the logits far past it."""
    ids = prompt_ids(tok, "chat")
    eps = model.cfg.rms_norm_eps
    try:
        model.cfg.rms_norm_eps = eps / 10
        with torch.inference_mode():
            wrong = model(torch.tensor([ids]))[0].double()
    finally:
        model.cfg.rms_norm_eps = eps
    assert (wrong - fp64_logits(ids)).abs().max().item() > 20 * fp64_tol[1]
