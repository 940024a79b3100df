"""The roofline arithmetic, a decode step's place on it, and that measuring the machine returns sane numbers.

Nothing here is timed: measuring functions are only checked to return sane numbers."""

from __future__ import annotations

import doctest
import math

import pytest
import torch

from nanoserve import kernels
from nanoserve.bench import roofline as roofline_module
from nanoserve.bench.roofline import (
    attainable_flops,
    decode_intensity,
    decode_limit_tok_s,
    forward_flops,
    forward_sweep,
    measure_roofline,
    ridge_point,
    step_roofline,
)
from nanoserve.model import Llama


def test_docstring_examples():
    assert doctest.testmod(roofline_module).failed == 0


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


def test_step_roofline_is_memory_bound_at_batch_one(model):
    point = step_roofline(model, 1, context=64, peak_flops=200e9, bandwidth=20e9)
    assert point.intensity == pytest.approx(0.5, rel=0.05)  # 2 FLOPs per 4-byte weight
    assert point.best_step_s == pytest.approx(model.weight_bytes() / 20e9, rel=0.05)
    assert step_roofline(model, 64, 64, 200e9, 20e9).attainable_flops == 200e9  # compute-bound by 64 rows


def test_step_roofline_counts_every_rows_kv_reads(tiny_model):
    cfg = tiny_model.cfg
    one, eight = (step_roofline(tiny_model, b, context=100, peak_flops=1e12, bandwidth=1e10) for b in (1, 8))
    kv = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * 100 * 4  # K and V of 100 tokens, fp32
    assert one.bytes == tiny_model.weight_bytes() + kv and eight.bytes == tiny_model.weight_bytes() + 8 * kv
    assert eight.flops == 8 * one.flops == 8 * forward_flops(cfg, 1, 99)
    assert eight.intensity > one.intensity  # the weights are read once for all rows


def test_forward_sweep_rows(tiny_model):
    rows = forward_sweep(tiny_model, [1, 4], repeats=1)
    assert [r["tokens"] for r in rows] == [1, 4] and all(r["seconds"] > 0 for r in rows)


def test_every_format_this_cpu_has_a_peak_and_a_bad_road_is_named(compiled):
    from nanoserve.bench.roofline import ComputePeak, best_peaks, matching_peak, measure_compute_peak, peak_roads

    roads = peak_roads()
    if not roads:
        pytest.skip("no peak loops off x86")
    formats = [f for f, _ in roads]
    assert "fp32" in formats and "int8" in formats and set(formats) <= {"fp32", "int8", "bf16"}
    assert ("int8", "avx2") in roads  # every x86 road here has AVX2's
    if "amx" in kernels.bf16_tiles_units():  # Intel's tile unit: a road of its own, first for int8 and bf16
        assert roads.index(("int8", "amx")) < roads.index(("int8", "avx512-vnni"))
        assert roads.index(("bf16", "amx")) < roads.index(("bf16", "avx512-bf16"))
        assert measure_compute_peak("int8", "amx", threads=1, seconds=0.01, repeats=1).ops_s > \
            measure_compute_peak("int8", "avx512-vnni", threads=1, seconds=0.01, repeats=1).ops_s
    peak = measure_compute_peak("fp32", roads[0][1], threads=1, seconds=0.01, repeats=1)
    assert peak.threads == 1 and 1e8 < peak.ops_s < 1e13
    assert torch.get_num_threads() >= 1  # threads restored
    with pytest.raises(RuntimeError, match="no peak loop for format 'fp64'"):
        compiled.peak_ops("fp64", "avx2", 10)
    with pytest.raises(RuntimeError, match="positive"):
        compiled.peak_ops("fp32", "avx2", 0)
    peaks = [ComputePeak("fp32", "avx2", 2, 1e11), ComputePeak("int8", "avx2", 2, 2e11),
             ComputePeak("int8", "avx-vnni", 2, 3e11), ComputePeak("int8", "avx2", 1, 1e11)]
    assert matching_peak(peaks, "int8", 2).road == "avx-vnni" and matching_peak(peaks, "int8", 1).ops_s == 1e11
    assert matching_peak(peaks, "bf16", 2).format == "fp32"  # widened to fp32 where AVX512_BF16 is not
    assert matching_peak(peaks, "fp32", 4) is None
    halved = [ComputePeak("fp32", "avx2", 2, 0.5e11), ComputePeak("int8", "avx2", 2, 2.5e11)]  # a core held a while
    best = {(p.format, p.road, p.threads): p.ops_s for p in best_peaks(peaks, halved)}
    assert best == {("fp32", "avx2", 2): 1e11, ("int8", "avx2", 2): 2.5e11, ("int8", "avx-vnni", 2): 3e11,
                    ("int8", "avx2", 1): 1e11}
