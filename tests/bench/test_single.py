"""`bench single` and `bench layout`'s bookkeeping: engines, medians and ratios, the streamer hook, the
layouts timed. Nothing is judged on its speed: each measuring function only has to return sane numbers."""

from __future__ import annotations

import pytest
import torch
import transformers

from nanoserve.bench.single import (
    ENGINES,
    LAYOUTS,
    Row,
    _TimerStreamer,
    forward_sweep,
    layout_groups,
    layout_rates,
    session_for,
    summarize_single,
    time_nanoserve,
    time_transformers,
    timed_greedy,
)
from nanoserve.bench.timing import StreamTimer
from nanoserve.engine import NoCacheSession, PagedSession
from nanoserve.generate import greedy_ids
from nanoserve.kv import CachedSession
from nanoserve.model import Llama
from nanoserve.model.weights import save_checkpoint


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


def test_every_layout_computes_the_same_product(tiny_cfg):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 64, generator=g)  # (out, in)
    x = torch.randn(1, 64, generator=g)
    want = x @ w.T
    with torch.inference_mode():
        for name, (prepare, call) in LAYOUTS.items():
            torch.testing.assert_close(call(x, prepare(w)).reshape(1, 96), want, atol=1e-5, rtol=1e-5, msg=name)


def test_summary_medians_and_ratios():
    rows = [Row("transformers", 128, 8, r, ttft_s=1.0, tpot_s=t) for r, t in enumerate([0.1, 0.2, 0.3])]
    rows += [Row("nanoserve-contiguous", 128, 8, r, ttft_s=0.5, tpot_s=t) for r, t in enumerate([0.05, 0.1, 0.5])]
    summary = {s["engine"]: s for s in summarize_single(rows, limit_tok_s=40.0)}
    assert summary["transformers"]["decode_tok_s"] == pytest.approx(5.0)  # median of 10, 5, 3.33
    assert summary["nanoserve-contiguous"]["decode_tok_s"] == pytest.approx(10.0)
    assert summary["nanoserve-contiguous"]["decode_vs_transformers"] == pytest.approx(2.0)
    assert summary["nanoserve-contiguous"]["paired_vs_transformers"] == pytest.approx(2.0)  # median of 2, 2, 0.6
    assert summary["nanoserve-contiguous"]["prefill_tok_s"] == pytest.approx(256.0)
    assert summary["nanoserve-contiguous"]["decode_vs_limit"] == pytest.approx(0.25)


def test_the_engines_are_the_roads_generate_can_take(tiny_model):
    assert ENGINES == ("nanoserve-nocache", "nanoserve-contiguous", "nanoserve", "transformers")
    assert isinstance(session_for(tiny_model, "nanoserve", 32), PagedSession)  # generate's default road
    assert isinstance(session_for(tiny_model, "nanoserve-contiguous", 32), CachedSession)
    assert isinstance(session_for(tiny_model, "nanoserve-nocache", 32), NoCacheSession)
    with pytest.raises(ValueError, match="unknown engine 'nanoserve-cache'"):
        session_for(tiny_model, "nanoserve-cache", 32)


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


@pytest.mark.parametrize("engine", ENGINES[:-1])
def test_time_nanoserve_counts_every_token(tiny_model, engine):
    t = time_nanoserve(tiny_model, [5, 6, 7], new_tokens=4, engine=engine)
    assert t.output_len == 4 and t.tpot is not None and t.ttft > 0


def test_timed_greedy_tokens_are_greedy_ids(tiny_model):
    ids, t = timed_greedy(tiny_model, [5, 6, 7], 6, session_for(tiny_model, "nanoserve", 16))
    assert ids == greedy_ids(tiny_model, [5, 6, 7], 6) and t.output_len == 6


def test_time_transformers_counts_only_new_tokens(tmp_path, tiny_model):
    hf = transformers.AutoModelForCausalLM.from_pretrained(save_checkpoint(tiny_model, tmp_path),
                                                           dtype=torch.float32).eval()
    t = time_transformers(hf, [5, 6, 7], new_tokens=4)
    assert t.output_len == 4 and t.ttft > 0
