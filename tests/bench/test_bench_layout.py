"""`bench layout`: the groups cover the step's matrices, every candidate computes the same product, the rows.
Nothing is judged on its speed."""

from __future__ import annotations

import pytest
import torch

from nanoserve.bench.layout import LAYOUTS, ONE_ROW_ONLY, layout_groups, layout_rates
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
