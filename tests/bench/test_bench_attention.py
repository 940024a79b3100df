"""`bench attention`'s counting and its CSV, on tiny shapes (nothing here is timed)."""

import torch

from nanoserve.bench import attention as ba
from nanoserve.bench.command import csv_header
from nanoserve.bench.timing import summarize


def test_the_ideal_is_every_key_and_value_read_once():
    assert ba.kv_ideal_bytes(32, 2048, 3, 64) == 2 * 32 * 2048 * 3 * 64 * 4


def test_every_road_computes_the_same_step(compiled):
    """Same numbers down every road, so the sweep times the same work (including split-K's pieces)."""
    roads = ba.decode_step(batch=3, context=ba.kernels.SPLIT_KEYS + 77, n_heads=4, n_kv_heads=2, head_dim=16,
                           block_size=16)
    assert set(roads) == set(ba.IMPLS)
    with torch.inference_mode():
        outs = {name: fn() for name, fn in roads.items()}
    for name, out in outs.items():
        torch.testing.assert_close(out, outs["gather"], atol=2e-6, rtol=1e-5, msg=name)


def test_measure_and_the_csv_round_trip(compiled, tmp_path):
    points = ba.measure(2, 40, n_heads=4, n_kv_heads=2, head_dim=16, block_size=16, repeats=5, budget_s=0.1,
                        read_bw=1e10, flush_bytes=2**16)
    assert [p.impl for p in points] == list(ba.IMPLS) and all(p.time.n == 5 for p in points)
    assert all(p.threads == torch.get_num_threads() for p in points)
    path = tmp_path / "a.csv"
    ba.write_csv(path, points, csv_header(["bench", "attention"], split_keys=512))
    meta, rows = ba.read_csv(path)
    assert meta["command"] == "python -m nanoserve bench attention" and meta["split_keys"] == "512"
    kernel = next(r for r in rows if r["impl"] == "kernel")
    assert kernel["x_kernel"] == 1.0 and kernel["moved_over_ideal"] == 1
    gather = next(r for r in rows if r["impl"] == "gather")
    assert gather["moved_over_ideal"] == 3 and gather["batch"] == 2 and gather["context"] == 40


def test_a_points_bandwidth_is_the_ideal_bytes_over_its_median():
    p = ba.Point("kernel", 1, 1, 1000, 16, summarize([0.001, 0.002, 0.003]), 4_000_000, 8e9)
    assert abs(p.gb_s - 2.0) < 1e-9
    row = p.row(summarize([0.001, 0.001, 0.001]))
    assert row["x_kernel"] == 2.0 and row["of_read_bw"] == 0.25
