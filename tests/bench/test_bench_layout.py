"""`bench layout`: the groups cover the step's matrices, every candidate computes the same product, the rows.
Nothing is judged on its speed."""

from __future__ import annotations

import pytest
import torch

from nanoserve.bench.layout import BF16_LAYOUTS, LAYOUTS, ONE_ROW_ONLY, bf16_layouts, layout_groups, layout_rates
from nanoserve.model import Llama


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
    assert [(r["group"], r["candidate"]) for r in rows] == [(g, c) for g in ("o", "lm head") for c in LAYOUTS]
    assert all(r["gb_s"] > 0 and r["matrices"] == (2 if r["group"] == "o" else 1) for r in rows)
    many = layout_rates(tiny_cfg, repeats=1, groups=["o"], rows=3)  # past one row: the candidates that take rows
    assert [r["candidate"] for r in many] == [c for c in LAYOUTS if c not in ONE_ROW_ONLY]
    assert all(r["rows"] == 3 and r["gflop_s"] == pytest.approx(3 * r["gb_s"] / 2) for r in many)


def test_every_layout_computes_the_same_product():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 64, generator=g)  # (out, in)
    x = torch.randn(3, 64, generator=g)
    want = x @ w.T
    with torch.inference_mode():
        for name, (prepare, call) in LAYOUTS.items():
            torch.testing.assert_close(call(x[:1], prepare(w)).reshape(1, 96), want[:1], atol=1e-5, rtol=1e-5, msg=name)
            if name not in ONE_ROW_ONLY:
                torch.testing.assert_close(call(x, prepare(w)), want, atol=1e-5, rtol=1e-5, msg=name)


def test_the_bf16_roads_compute_the_bf16_product_and_are_timed_on_their_bytes(tiny_cfg):
    """Each bf16 candidate this machine has (oneDNN's, the tiles on AVX512_BF16) is x and W in bf16 summed in fp32,
    rounded to bf16: within 2^-8 of the fp64 sum of the same numbers, plus fp32's chain error; timed on W's bf16
    bytes, half fp32's."""
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(96, 64, generator=g), torch.randn(3, 64, generator=g)
    want = x.bfloat16().double() @ w.bfloat16().double().T
    size = x.bfloat16().double().abs() @ w.bfloat16().double().abs().T
    with torch.inference_mode():
        for name in bf16_layouts():
            prepare, call = BF16_LAYOUTS[name]
            got = call(x, prepare(w))
            assert got.dtype == torch.bfloat16
            assert bool(((got.double() - want).abs() <= 2**-8 * want.abs() + 64 * 2**-24 * size).all()), name
    rows = layout_rates(tiny_cfg, repeats=1, groups=["o"], rows=3, bf16=True)
    fp32 = layout_rates(tiny_cfg, repeats=1, groups=["o"], rows=3, candidates=["F.linear, W stored [in,out]"])
    assert [r["candidate"] for r in rows] == bf16_layouts()
    assert all(r["mbytes"] == pytest.approx(fp32[0]["mbytes"] / 2) and r["gflop_s"] > 0 for r in rows)
