"""The roofline arithmetic, the benchmark's bookkeeping, and the weight layout the roofline chose.

Nothing here is timed: measuring functions are only checked to return sane numbers."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from nanoserve.bench import (
    LAYOUTS,
    Row,
    _TimerStreamer,
    forward_sweep,
    layout_groups,
    layout_rates,
    summarize_single,
    time_nanoserve,
)
from nanoserve.config import ModelConfig
from nanoserve.model import Llama, linear, linear_weight
from nanoserve.roofline import (
    attainable_flops,
    decode_intensity,
    decode_limit_tok_s,
    forward_flops,
    measure_roofline,
    ridge_point,
)
from nanoserve.timing import StreamTimer
from nanoserve.weights import load_model, save_checkpoint


def test_decode_limit_is_bandwidth_over_weight_bytes():
    assert decode_limit_tok_s(538e6, 25e9) == pytest.approx(46.47, abs=0.01)
    assert decode_limit_tok_s(269e6, 25e9) == pytest.approx(2 * decode_limit_tok_s(538e6, 25e9))  # bf16
    with pytest.raises(ValueError, match="must be positive"):
        decode_limit_tok_s(0, 25e9)


def test_decode_intensity_grows_with_batch_and_falls_with_kv_reads():
    assert decode_intensity(134e6) == 0.5  # fp32: 2 FLOPs per 4-byte weight
    assert decode_intensity(134e6, batch=16) == 8.0
    assert decode_intensity(134e6, bytes_per_param=2) == 1.0  # bf16 halves the bytes
    assert decode_intensity(134e6, batch=16, kv_bytes=100e6) < 8.0
    with pytest.raises(ValueError):
        decode_intensity(134e6, batch=0)


def test_attainable_flops_is_the_roofline():
    peak, bw = 1e11, 2.5e10
    ridge = ridge_point(peak, bw)
    assert ridge == 4.0
    assert attainable_flops(0.5, peak, bw) == 0.5 * bw  # memory-bound: slope = bandwidth
    assert attainable_flops(ridge, peak, bw) == pytest.approx(peak)  # the corner
    assert attainable_flops(100.0, peak, bw) == peak  # compute-bound: flat
    xs = [0.1 * 2**i for i in range(12)]
    ys = [attainable_flops(x, peak, bw) for x in xs]
    assert ys == sorted(ys)  # never decreases with intensity


def test_forward_flops_counts_two_per_weight_plus_attention(tiny_cfg):
    model = Llama(tiny_cfg)
    matrix_params = sum(p.numel() for p in model.parameters() if p.dim() == 2)  # tied: the head is the table
    cfg = tiny_cfg
    attn_pair = 4 * cfg.n_layers * cfg.n_heads * cfg.head_dim
    assert forward_flops(cfg, 1) == 2 * matrix_params + attn_pair  # one token sees itself
    head = 2 * cfg.vocab_size * cfg.hidden_size
    # 10 tokens: the body 10 times, the head once (last_only), 55 causal pairs
    assert forward_flops(cfg, 10) == 10 * (2 * matrix_params - head) + head + 55 * attn_pair
    assert forward_flops(cfg, 1, context=99) == forward_flops(cfg, 1) + 99 * attn_pair  # a decode step at 100
    assert forward_flops(cfg, 10, last_only=False) == 10 * 2 * matrix_params + 55 * attn_pair


def test_measure_roofline_returns_sane_numbers():
    r = measure_roofline(gemm_n=128, buffer_bytes=8 * 2**20, repeats=2)
    assert all(math.isfinite(v) and v > 0 for v in (r.peak_flops, r.read_bandwidth, r.copy_bandwidth))
    assert "GFLOP/s" in r.describe() and r.threads == torch.get_num_threads()


# ---- the benchmark's bookkeeping ------------------------------------------------------------------


def test_layout_groups_cover_every_matrix_a_decode_step_reads(tiny_cfg):
    """Fused groups + o + down + LM head = all the model's matrix bytes (only the norms are left)."""
    groups = layout_groups(tiny_cfg)
    fused = ["qkv fused", "o", "gate/up fused", "down", "lm head"]
    matrix_bytes = 4 * sum(o * i for g in fused for o, i in groups[g])
    model = Llama(tiny_cfg)
    norm_bytes = 4 * sum(p.numel() for n, p in model.named_parameters() if "norm" in n)
    assert matrix_bytes == model.weight_bytes() - norm_bytes
    assert sum(o * i for o, i in groups["q, k, v split"]) == sum(o * i for o, i in groups["qkv fused"])
    assert sum(o * i for o, i in groups["gate, up split"]) == sum(o * i for o, i in groups["gate/up fused"])


def test_layout_rates_rows(tiny_cfg):
    rows = layout_rates(tiny_cfg, repeats=1, groups=["o", "lm head"])
    assert {r["group"] for r in rows} == {"o", "lm head"}
    assert len(rows) == 2 * len(LAYOUTS) and all(r["gb_s"] > 0 for r in rows)


def test_summary_medians_and_ratios():
    rows = [Row("transformers", 128, 8, r, ttft_s=1.0, tpot_s=t) for r, t in enumerate([0.1, 0.2, 0.3])]
    rows += [Row("nanoserve-cache", 128, 8, r, ttft_s=0.5, tpot_s=t) for r, t in enumerate([0.05, 0.1, 0.5])]
    summary = {s["engine"]: s for s in summarize_single(rows, limit_tok_s=40.0)}
    assert summary["transformers"]["decode_tok_s"] == pytest.approx(5.0)  # median of 10, 5, 3.33
    assert summary["nanoserve-cache"]["decode_tok_s"] == pytest.approx(10.0)
    assert summary["nanoserve-cache"]["decode_vs_transformers"] == pytest.approx(2.0)
    assert summary["nanoserve-cache"]["paired_vs_transformers"] == pytest.approx(2.0)  # median of 2, 2, 0.6
    assert summary["nanoserve-cache"]["prefill_tok_s"] == pytest.approx(256.0)
    assert summary["nanoserve-cache"]["decode_vs_limit"] == pytest.approx(0.25)


def test_transformers_streamer_skips_the_prompt():
    ticks = iter([0.0, 1.0, 1.5, 2.0])
    timer = StreamTimer(clock=lambda: next(ticks))
    timer.start()
    streamer = _TimerStreamer(timer)
    streamer.put("prompt ids")  # generate() hands over the prompt first: not a token
    streamer.put("token 1")
    streamer.put("token 2")
    t = timer.finish()
    assert (t.ttft, t.output_len, t.tpot) == (1.0, 2, 1.0)


def test_forward_sweep_rows(tiny_model):
    rows = forward_sweep(tiny_model, [1, 4], repeats=1)
    assert [r["tokens"] for r in rows] == [1, 4] and all(r["seconds"] > 0 for r in rows)


@pytest.mark.parametrize("cached", [True, False])
def test_time_nanoserve_counts_every_token(tiny_model, cached):
    t = time_nanoserve(tiny_model, [5, 6, 7], new_tokens=4, cached=cached)
    assert t.output_len == 4 and t.tpot is not None and t.ttft > 0


# ---- the layout the roofline chose ------------------------------------------------------------------


def test_linear_weights_are_stored_in_out_and_stay_so(tmp_path, tiny_cfg):
    """Every matrix keeps its (out, in) shape but is contiguous as (in, out), through dtype and load."""
    model = Llama.random(tiny_cfg, seed=0)

    def matrices(m):
        return [p for n, p in m.named_parameters() if p.dim() == 2]

    assert all(p.t().is_contiguous() for p in matrices(model))
    assert model.layers[0].wqkv.shape == (
        (tiny_cfg.n_heads + 2 * tiny_cfg.n_kv_heads) * tiny_cfg.head_dim, tiny_cfg.hidden_size)
    assert all(p.t().is_contiguous() for p in matrices(model.to(torch.bfloat16)))
    loaded = load_model(save_checkpoint(Llama.random(tiny_cfg, seed=0), tmp_path))
    assert all(p.t().is_contiguous() for p in matrices(loaded))
    untied = Llama.random(ModelConfig.tiny(tie_word_embeddings=False))
    assert untied.embed.is_contiguous() and untied.lm_head.t().is_contiguous()  # lookup table stays row-major


def test_linear_one_row_takes_the_weighted_row_sum_and_agrees_with_f_linear(tiny_cfg):
    g = torch.Generator().manual_seed(0)
    w = linear_weight(96, 64)
    with torch.no_grad():
        w.copy_(torch.randn(96, 64, generator=g))
    x = torch.randn(1, 1, 64, generator=g)
    torch.testing.assert_close(linear(x, w), F.linear(x, w), atol=1e-5, rtol=1e-5)  # the embedding_bag road
    rows = torch.randn(3, 5, 64, generator=g)
    assert torch.equal(linear(rows, w), F.linear(rows, w))  # more rows: plain F.linear
    row_major = w.detach().contiguous()
    assert torch.equal(linear(x, row_major), F.linear(x, row_major))  # other layouts: plain F.linear
    assert linear(x.bfloat16(), w.bfloat16()).dtype == torch.bfloat16
    w.grad = None
    linear(x, w).sum().backward()  # still differentiable (the cached indices are ordinary tensors)
    torch.testing.assert_close(w.grad, x.reshape(1, 64).expand(96, 64))
