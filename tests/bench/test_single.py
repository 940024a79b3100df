"""`bench single` and `bench layout`'s bookkeeping: roads, medians and ratios, the layouts timed. Nothing is
judged on its speed: each measuring function only has to return sane numbers (or, on a fake clock, exact ones)."""

from __future__ import annotations

import pytest
import torch
import transformers

from nanoserve.bench.single import (
    ENGINES,
    LAYOUTS,
    SingleRun,
    forward_sweep,
    layout_groups,
    layout_rates,
    summarize_single,
    time_nanoserve,
    time_transformers,
    timed_greedy,
)
from nanoserve.generate import greedy_ids
from nanoserve.model import Llama
from nanoserve.model.weights import save_checkpoint
from nanoserve.stages import NoCacheSession, cached_session


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


def test_every_layout_computes_the_same_product():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 64, generator=g)  # (out, in)
    x = torch.randn(1, 64, generator=g)
    want = x @ w.T
    with torch.inference_mode():
        for name, (prepare, call) in LAYOUTS.items():
            torch.testing.assert_close(call(x, prepare(w)).reshape(1, 96), want, atol=1e-5, rtol=1e-5, msg=name)


def test_summary_medians_and_ratios():
    rows = [SingleRun("transformers", 128, 8, r, ttft_s=1.0, tpot_s=t) for r, t in enumerate([0.1, 0.2, 0.3])]
    rows += [SingleRun("nanoserve-contiguous", 128, 8, r, ttft_s=0.5, tpot_s=t) for r, t in enumerate([0.05, 0.1, 0.5])]
    summary = {s["engine"]: s for s in summarize_single(rows, limit_tok_s=40.0)}
    assert list(summary) == ["nanoserve-contiguous", "transformers"]  # in ENGINES' order
    assert summary["transformers"]["decode_tok_s"] == pytest.approx(5.0)  # median of 10, 5, 3.33
    assert summary["nanoserve-contiguous"]["decode_tok_s"] == pytest.approx(10.0)
    assert summary["nanoserve-contiguous"]["decode_vs_transformers"] == pytest.approx(2.0)
    assert summary["nanoserve-contiguous"]["paired_vs_transformers"] == pytest.approx(2.0)  # median of 2, 2, 0.6
    assert summary["nanoserve-contiguous"]["prefill_tok_s"] == pytest.approx(256.0)
    assert summary["nanoserve-contiguous"]["decode_vs_limit"] == pytest.approx(0.25)


def test_the_roads_are_generates_and_the_stages(tiny_model):
    assert ENGINES == ("nanoserve-nocache", "nanoserve-contiguous", "nanoserve", "transformers")
    with pytest.raises(KeyError):
        time_nanoserve(tiny_model, [5, 6, 7], 2, "nanoserve-cache")


def test_forward_sweep_rows(tiny_model):
    rows = forward_sweep(tiny_model, [1, 4], repeats=1)
    assert [r["tokens"] for r in rows] == [1, 4] and all(r["seconds"] > 0 for r in rows)


@pytest.mark.parametrize("engine", ENGINES[:-1])
def test_time_nanoserve_counts_every_token(tiny_model, engine):
    t = time_nanoserve(tiny_model, [5, 6, 7], new_tokens=4, engine=engine)
    assert t.output_len == 4 and t.tpot is not None and t.ttft > 0


@pytest.mark.parametrize("stage", [None, "contiguous", "nocache"])
def test_timed_greedy_tokens_are_greedy_ids_on_every_road(tiny_model, stage):
    session = {None: None, "contiguous": cached_session(tiny_model, 16), "nocache": NoCacheSession(tiny_model)}
    ticks = iter(range(100))
    ids, t = timed_greedy(tiny_model, [5, 6, 7], 6, session[stage], clock=lambda: float(next(ticks)))
    assert ids == greedy_ids(tiny_model, [5, 6, 7], 6) and (t.output_len, t.ttft, t.tpot) == (6, 1.0, 1.2)


def test_time_transformers_counts_only_new_tokens(tmp_path, tiny_model):
    hf = transformers.AutoModelForCausalLM.from_pretrained(save_checkpoint(tiny_model, tmp_path),
                                                           dtype=torch.float32).eval()
    ticks = iter(range(100))
    t = time_transformers(hf, [5, 6, 7], new_tokens=4, clock=lambda: float(next(ticks)))
    assert (t.output_len, t.ttft) == (4, 1.0) and t.tpot == pytest.approx(4 / 3)  # one more reading at the end
