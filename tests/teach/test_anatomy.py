"""teach.anatomy: the functions Days 01-06 draw from, pinned on a tiny model and on SmolLM2."""

from __future__ import annotations

import json
import math

import pytest
import torch

from nanoserve.attention.causal import causal_attention
from nanoserve.config import CheckpointError
from nanoserve.model import apply_rope, rms_norm, rope_cos_sin
from nanoserve.model.weights import hf_state_dict, save_checkpoint
from nanoserve.teach.anatomy import (
    AttentionRecorder,
    Piece,
    attention_probs,
    block_parts,
    format_pieces,
    levels_per_block,
    parameter_counts,
    pieces_html,
    repeat_kv,
    residual_stream,
    rope_angles,
    rope_view,
    rotated_dot,
    safetensors_header,
    sublayer_norms,
    tensor_inventory,
    token_pieces,
)

# ------------------------------------------------------------------ inventory


@pytest.fixture(scope="module")
def tiny_folder(tiny_model, tmp_path_factory):
    return save_checkpoint(tiny_model, tmp_path_factory.mktemp("tiny"))


def test_inventory_matches_the_saved_tensors(tiny_model, tiny_folder):
    inv = tensor_inventory(tiny_folder)
    sd = hf_state_dict(tiny_model)
    assert {t.name: t.shape for t in inv} == {k: tuple(v.shape) for k, v in sd.items()}
    assert all(t.dtype == "F32" and t.nbytes == 4 * t.numel for t in inv)
    assert sum(t.numel for t in inv) == tiny_model.num_parameters()
    # forward order: embeddings first, layer 0 before layer 1, final norm last
    assert inv[0].name == "model.embed_tokens.weight" and inv[-1].name == "model.norm.weight"
    assert [t.layer for t in inv[1:-1]] == sorted(t.layer for t in inv[1:-1])
    assert [t.module for t in inv[1:10]] == [
        "input_layernorm", "q_proj", "k_proj", "v_proj", "o_proj",
        "post_attention_layernorm", "gate_proj", "up_proj", "down_proj",
    ]


def test_parameter_counts_group_by_module(tiny_cfg, tiny_folder):
    counts = parameter_counts(tensor_inventory(tiny_folder))
    C, L = tiny_cfg.hidden_size, tiny_cfg.n_layers
    assert list(counts)[0] == "embed_tokens" and list(counts)[-1] == "norm"
    assert counts["embed_tokens"] == tiny_cfg.vocab_size * C
    assert counts["k_proj"] == L * tiny_cfg.n_kv_heads * tiny_cfg.head_dim * C
    assert counts["gate_proj"] == counts["up_proj"] == counts["down_proj"] == L * tiny_cfg.intermediate_size * C
    assert "lm_head" not in counts  # tied: the file holds the matrix once


def test_inventory_layers_sort_numerically(tmp_path):
    from safetensors.torch import save_file

    names = [f"model.layers.{i}.mlp.up_proj.weight" for i in (10, 2, 1)]
    save_file({n: torch.zeros(2, 3) for n in names}, str(tmp_path / "model.safetensors"))
    assert [t.layer for t in tensor_inventory(tmp_path)] == [1, 2, 10]


def test_inventory_errors_name_the_file(tmp_path):
    with pytest.raises(CheckpointError, match="model.safetensors"):
        tensor_inventory(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x05\x00")
    with pytest.raises(CheckpointError, match="not a readable safetensors header"):
        tensor_inventory(tmp_path)
    header = json.dumps({"w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 20]}}).encode()
    (tmp_path / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + bytes(20))
    with pytest.raises(CheckpointError, match="'w' holds 20 bytes"):
        tensor_inventory(tmp_path)
    (tmp_path / "model.safetensors").write_bytes((10**9).to_bytes(8, "little") + b"{}")
    with pytest.raises(CheckpointError, match="exceeds the file"):
        tensor_inventory(tmp_path)
    header = json.dumps({"w": {"dtype": "F32", "shape": [2, 3]}}).encode()
    (tmp_path / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    with pytest.raises(CheckpointError, match="'w' has a malformed header entry"):
        tensor_inventory(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text("[]")
    with pytest.raises(CheckpointError, match="not a valid safetensors index"):
        tensor_inventory(tmp_path)


def test_real_inventory_totals_the_model(model, model_dir):
    inv = tensor_inventory(model_dir)
    assert sum(t.numel for t in inv) == model.num_parameters()
    assert sum(t.nbytes for t in inv) == model.weight_bytes()
    header = safetensors_header(model_dir / "model.safetensors")
    assert len(header) == len(inv) == 2 + 9 * model.cfg.n_layers


def test_levels_per_block_sees_4bit_quantization():
    from gguf import GGMLQuantizationType, quants

    x = torch.randn(8, 128, generator=torch.Generator().manual_seed(0))
    q41 = quants.dequantize(quants.quantize(x.numpy(), GGMLQuantizationType.Q4_1), GGMLQuantizationType.Q4_1)
    assert levels_per_block(torch.from_numpy(q41)).max() <= 16
    assert levels_per_block(x).min() == 32  # fp32 noise: every value distinct
    assert levels_per_block(torch.zeros(2, 64)).tolist() == [[1, 1], [1, 1]]
    with pytest.raises(ValueError, match="matrix"):
        levels_per_block(torch.zeros(2, 40))


# ------------------------------------------------------------------ tokens


def test_token_pieces_mark_split_characters(tok):
    pieces = token_pieces(tok, "Hi 日本")
    assert [p.text for p in pieces] == ["Hi", " 日", "日", "日", "本"]  # ' 日' is split over three tokens
    assert [p.id for p in pieces] == tok.encode("Hi 日本")
    assert [p.whole for p in pieces] == [True, False, False, False, True]
    assert tok.decode(p.id for p in pieces) == "Hi 日本"


def test_format_and_html():
    ps = [Piece(1, "a b", "aĠb", True), Piece(2, "\n", "Ċ", True), Piece(3, "é", "Ã", False)]
    assert format_pieces(ps) == "a·b|↵|[é]"
    page = pieces_html([Piece(4, "<b>", "<b>", True)])
    assert "&lt;b&gt;" in page and "<b>" not in page.replace("<div>", "") and "1 tokens" in page


# ------------------------------------------------------------------ RoPE


def test_rope_angles_and_view(tiny_model):
    f = tiny_model.inv_freq
    a = rope_angles(f, [0, 3, 100])
    assert a.shape == (3, len(f)) and torch.equal(a[0], torch.zeros(len(f)))
    assert a[2, 1].item() == pytest.approx(100 * f[1].item())
    v = rope_view(f, 100, 1, trail=5)
    assert v.wavelength == pytest.approx(2 * math.pi / f[1].item())
    assert 0 <= v.angle < 2 * math.pi and (v.cos, v.sin) == pytest.approx(v.trail[-1])
    assert len(v.trail) == 5 and v.cos == pytest.approx(math.cos(100 * f[1].item()))
    with pytest.raises(ValueError, match="pair"):
        rope_view(f, 0, len(f))
    with pytest.raises(ValueError, match="position"):
        rope_view(f, -1, 0)


def test_rope_preserves_norms(tiny_model):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 50, 3, tiny_model.cfg.head_dim, generator=g)  # (B, T, heads, D)
    cos, sin = rope_cos_sin(tiny_model.inv_freq, torch.randint(0, 5000, (2, 50), generator=g))
    torch.testing.assert_close(apply_rope(x, cos, sin).norm(dim=-1), x.norm(dim=-1))


def test_rope_score_depends_only_on_offset(model):
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(2, model.cfg.head_dim, generator=g)
    f = model.inv_freq
    for m, n in [(5, 2), (40, 40), (3, 30)]:
        base = rotated_dot(q, k, m, n, f)
        for shift in (1, 17, 1000):
            assert rotated_dot(q, k, m + shift, n + shift, f) == pytest.approx(base, abs=2e-3)
    assert rotated_dot(q, k, 0, 0, f) == pytest.approx(float(q @ k), abs=1e-5)
    assert abs(rotated_dot(q, k, 5, 2, f) - rotated_dot(q, k, 5, 3, f)) > 1e-2  # the offset does matter


# ------------------------------------------------------------------ attention


def _qkv(cfg, T=7, B=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    H, K, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    q = torch.randn(B, T, H, D, generator=g)
    return q, torch.randn(B, T, K, D, generator=g), torch.randn(B, T, K, D, generator=g)


def test_probs_are_causal_distributions(tiny_cfg):
    q, k, _ = _qkv(tiny_cfg)
    p = attention_probs(q, k)  # (B, H, T, T)
    assert p.shape == (2, tiny_cfg.n_heads, 7, 7)
    torch.testing.assert_close(p.sum(-1), torch.ones(2, tiny_cfg.n_heads, 7))
    assert torch.all(p.triu(1) == 0) and torch.all(p[..., 0, 0] == 1)


def test_grouped_heads_read_their_kv_head(tiny_cfg):
    q, k, _ = _qkv(tiny_cfg)
    p = attention_probs(q, k)
    n_rep = tiny_cfg.n_rep
    for h in range(tiny_cfg.n_heads):  # one head by hand: query head h against kv head h // n_rep
        s = q[:, :, h] @ k[:, :, h // n_rep].transpose(1, 2) / math.sqrt(tiny_cfg.head_dim)  # (B, T, T)
        s = s.masked_fill(torch.ones(7, 7, dtype=torch.bool).triu(1), float("-inf"))
        torch.testing.assert_close(p[:, h], s.softmax(-1))
    assert torch.equal(repeat_kv(k, n_rep)[:, :, n_rep], k[:, :, 1])


def test_recorder_output_equals_causal_attention(tiny_cfg):
    q, k, v = _qkv(tiny_cfg, T=11)
    rec = AttentionRecorder(layers=[3])
    torch.testing.assert_close(rec(3, q, k, v), causal_attention(q, k, v), atol=1e-5, rtol=1e-5)
    rec(4, q, k, v)
    assert list(rec.probs) == [3] and rec.probs[3].shape == (2, tiny_cfg.n_heads, 11, 11)


def test_recorder_as_model_backend(tiny_model):
    ids = torch.randint(0, tiny_model.cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(2))
    rec = AttentionRecorder()
    with torch.no_grad():
        torch.testing.assert_close(tiny_model(ids, kv=rec), tiny_model(ids), atol=1e-4, rtol=1e-4)
    assert sorted(rec.probs) == list(range(tiny_model.cfg.n_layers))


# ------------------------------------------------------------------ block and residual stream


def test_block_parts_match_block_forward_bit_for_bit(tiny_model, road):
    """block_parts makes Block.forward's own calls (Block.attention, Block.mlp), on either road of the small ops."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 6, tiny_model.cfg.hidden_size, generator=g)
    cos, sin = rope_cos_sin(tiny_model.inv_freq, torch.arange(6).expand(2, 6))
    blk = tiny_model.layers[1]
    kv = lambda i, q, k, v: causal_attention(q, k, v)
    with torch.inference_mode():
        parts = block_parts(blk, x, cos, sin, 1, kv, compiled=road == "compiled")
        assert torch.equal(parts["out"], blk(x, cos, sin, 1, kv, compiled=road == "compiled"))
    assert torch.equal(parts["mid"], x + parts["attn_out"])
    torch.testing.assert_close(parts["out"], x + parts["attn_out"] + parts["mlp_out"])
    gate, up = parts["gate"], parts["up"]
    torch.testing.assert_close(parts["act"], torch.nn.functional.silu(gate) * up, atol=1e-6, rtol=1e-6)
    assert parts["act"].shape == (2, 6, tiny_model.cfg.intermediate_size)


def test_residual_stream_ends_in_hidden_states(tiny_model):
    ids = [5, 9, 200, 3, 3]
    stream = residual_stream(tiny_model, ids)  # (L+1, T, C)
    assert stream.shape == (tiny_model.cfg.n_layers + 1, 5, tiny_model.cfg.hidden_size)
    assert torch.equal(stream[0], tiny_model.embed[ids].detach())
    with torch.no_grad():
        final = tiny_model.hidden_states(torch.tensor([ids]))[0]
    torch.testing.assert_close(rms_norm(stream[-1], tiny_model.norm.detach(), tiny_model.cfg.rms_norm_eps), final)


def test_sublayer_norms_add_up_to_the_stream(tiny_model):
    ids = [7, 1, 42, 42]
    s = sublayer_norms(tiny_model, ids)
    stream = residual_stream(tiny_model, ids)
    assert s["attn"].shape == s["mlp"].shape == (tiny_model.cfg.n_layers, 4)
    # triangle inequality: a layer cannot move the stream further than its two writes together
    moved = (stream[1:] - stream[:-1]).norm(dim=-1)
    assert torch.all(moved <= s["attn"] + s["mlp"] + 1e-4) and torch.all(moved > 0)
