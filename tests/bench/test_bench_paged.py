"""`python -m nanoserve bench paged`'s parts: the memory trace on a real BlockPool, the paged and contiguous
sessions it compares, the comparison on a fake clock, and its CSV."""

from __future__ import annotations

import pytest
import torch

from nanoserve.bench.command import csv_header
from nanoserve.bench.paged import (
    Comparison,
    contiguous_at,
    measure_context,
    paged_like,
    read_csv,
    utilisation_trace,
    write_csv,
)
from nanoserve.bench.timing import summarize


def test_utilisation_trace_counts_real_blocks():
    pts = utilisation_trace([(3, 2)], block_size=2, max_len=8, max_running=1)
    assert [(p.tokens, p.paged_slots, p.contiguous_slots) for p in pts] == [(3, 4, 8), (4, 4, 8), (5, 6, 8)]
    with pytest.raises(ValueError, match="max_len=8"):
        utilisation_trace([(5, 4)], block_size=2, max_len=8, max_running=1)


def test_utilisation_paged_wastes_under_one_block_per_request():
    reqs = [(7, 30), (50, 3), (1, 90), (20, 20)] * 3
    for p in utilisation_trace(reqs, block_size=16, max_len=128, max_running=3):
        assert 0 <= p.paged_slots - p.tokens < 16 * p.running
        assert p.contiguous_slots == 128 * p.running
        assert p.paged_utilisation >= p.contiguous_utilisation


def test_the_paged_copy_holds_the_contiguous_sessions_kv(tiny_model):
    contiguous = contiguous_at(tiny_model, context=21, room=3)
    paged = paged_like(tiny_model, contiguous, block_size=4, room=3)
    assert paged.runner.attention == "reference"  # the gather is what the benchmark measures
    assert sorted(paged.table.blocks) != paged.table.blocks  # blocks drawn from a shuffled free list
    for layer in range(tiny_model.cfg.n_layers):
        k, v = paged.runner.storage.gather(layer, paged.table.blocks, 21)  # (21, K, D)
        assert torch.equal(k, contiguous.cache.k[layer, 0, :, :21].transpose(0, 1))
        assert torch.equal(v, contiguous.cache.v[layer, 0, :, :21].transpose(0, 1))


def test_measure_context_compares_both_measures_at_every_block_size(tiny_model):
    ticks = iter(range(10**6))
    rows = measure_context(tiny_model, 20, [4, 16], step_repeats=2, read_repeats=3, clock=lambda: float(next(ticks)))
    assert [(r.measure, r.block_size) for r in rows] == [("step", 4), ("read", 4), ("step", 16), ("read", 16)]
    assert all(r.context == 20 and r.ratio == 1.0 for r in rows)  # one tick per timed call on both sides
    assert [r.paged.n for r in rows] == [2, 3, 2, 3]


def test_bench_csv_roundtrip(tmp_path):
    s = summarize([0.002, 0.001, 0.003])
    rows = [Comparison("step", 128, 16, s, summarize([0.004, 0.004, 0.004]))]
    header = csv_header(["bench", "paged"], clock="wall")
    write_csv(tmp_path / "b.csv", rows, header)
    meta, back = read_csv(tmp_path / "b.csv")
    assert meta["command"] == "python -m nanoserve bench paged" and meta["clock"] == "wall"
    assert "threads" in meta["machine"]
    assert back[0]["measure"] == "step" and back[0]["context"] == 128 and back[0]["ratio"] == 2.0
    assert back[0]["contiguous_ms"] == 2.0 and back[0]["n"] == 3 and back[0]["paged_p90_ms"] == 4.0
