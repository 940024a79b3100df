"""The one CSV format under data/: header lines and a table, written and read in one place; and every committed
CSV read back by its command's reader."""

from __future__ import annotations

import doctest
import math
from dataclasses import dataclass
from pathlib import Path

import pytest

from nanoserve.bench import csvio

DATA = Path(__file__).resolve().parents[2] / "data"


@dataclass(frozen=True)
class Rec:
    name: str
    n: int
    x: float
    ok: bool
    extra: int = 7  # a column older files lack


def test_header_and_rows_round_trip(tmp_path):
    meta = {"command": "python -m nanoserve bench x --out 'a b.csv'", "machine": "cpu | AVX2 | 2 cores",
            "same": True, "scheduler": {"max_num_seqs": 8}, "peaks": [1.5, None], "note": "two\nlines"}
    path = csvio.write_csv(tmp_path / "sub" / "x.csv", [{"a": 1, "b": "x"}, {"a": 2}], meta, ["a", "b"])
    lines = path.read_text().splitlines()
    assert lines[0] == "# command: python -m nanoserve bench x --out 'a b.csv'" and lines[6] == "a,b"
    back, rows = csvio.read_csv(path)
    assert back["same"] == "true" and back["scheduler"] == '{"max_num_seqs": 8}' and back["note"] == "two lines"
    assert rows == [{"a": "1", "b": "x"}, {"a": "2", "b": ""}]  # a row without a field leaves it empty
    assert csvio.decoded(back) == {**meta, "note": "two lines"}
    assert csvio.read_csv(path, parse=True)[1] == [{"a": 1, "b": "x"}, {"a": 2, "b": None}]


def test_numbers_parse_to_their_kind():
    assert [csvio.number(t) for t in ("3", "-2", "0.25", "1e3", "", "spec-k5", "1 2 3")] == [
        3, -2, 0.25, 1000.0, None, "spec-k5", "1 2 3"]
    assert math.isinf(csvio.number("inf")) and math.isnan(csvio.number("nan"))


def test_records_cast_by_annotation_and_default_missing_columns(tmp_path):
    path = csvio.write_csv(tmp_path / "r.csv", [Rec("a", 1, 0.5, True, 3)])
    assert csvio.records(Rec, csvio.read_csv(path)[1]) == [Rec("a", 1, 0.5, True, 3)]
    old = [{"name": "b", "n": "2", "x": "1.5", "ok": "0"}]
    assert csvio.records(Rec, old) == [Rec("b", 2, 1.5, False, 7)]


def test_a_second_table_goes_beside_the_csv():
    assert str(csvio.beside("data/bench-numerics.csv", "greedy")) == "data/bench-numerics-greedy.csv"
    assert csvio.beside(Path("out/arr.csv"), "requests") == Path("out/arr-requests.csv")


def test_docstring_examples():
    assert doctest.testmod(csvio).failed == 0


def test_every_committed_csv_reads_with_its_commands_reader():
    from nanoserve.bench import arrivals, attention, batch, chunked, decode, engine, paged, spec

    meta, runs = batch.read_run(DATA / "day-29-batchbench.csv")
    assert meta["rounds"] == 5 and runs[0][0] == "blocking" and runs[0][1].issued_tokens == 248
    for name in ("day-29-batchbench-avx2.csv", "day-29-batchbench-prompt320.csv"):
        assert batch.read_run(DATA / name)[1]
    meta, rows = paged.read_csv(DATA / "day-20-paged-vs-contiguous.csv")
    assert meta["clock"] == "wall" and rows[0]["context"] == 128 and isinstance(rows[0]["ratio"], float)
    meta, rows = attention.read_csv(DATA / "bench-attention.csv")
    assert meta["split_keys"] == "512" and {r["impl"] for r in rows} == set(attention.IMPLS)
    meta, rows = decode.read_csv(DATA / "bench-decode.csv")
    first_gguf = next(r for r in rows if (r.engine, r.weights, r.batch) == ("nanoserve", "gguf", 1))
    assert rows[0].engine == "nanoserve" and decode.by_batch(rows)["gguf"][1] == first_gguf.tok_s
    meta, rows = engine.read_csv(DATA / "bench-engine.csv")
    assert {s.system for s in engine.summarize(rows)} >= {"nanoserve-engine", "transformers-cb"}
    meta, runs = chunked.read_csv(DATA / "bench-chunked.csv")
    assert meta["decoders"] == "8" and chunked.median_summaries([chunked.summarize_run(r) for r in runs])
    for name in ("bench-arrivals.csv", "bench-arrivals-long.csv"):
        meta, summary = arrivals.read_summary(DATA / name)
        requests = arrivals.read_requests(DATA / name)
        assert all(isinstance(r["completed"], float) for r in summary)
        assert arrivals.goodput_under(summary, requests, arrivals.SLO())
    meta, runs, steps = spec.read_csv(DATA / "bench-spec.csv")
    assert {r.concurrency for r in runs} == {1, 8} and spec.step_costs(steps)[1] == 1.0
    assert all(s.same_as_plain for s in spec.summarize(runs))
    for name in ("bench-layout.csv", "bench-shared.csv", "bench-outputs.csv"):
        meta, rows = csvio.read_csv(DATA / name, parse=True)
        assert meta["command"].startswith("python -m nanoserve bench") and rows


@pytest.mark.parametrize("path", sorted(DATA.glob("bench-*.csv")) + sorted(DATA.glob("day-*.csv")), ids=str)
def test_every_committed_csv_opens_with_its_command_and_machine(path):
    meta, rows = csvio.read_csv(path)
    assert meta["command"].startswith("python -m nanoserve") and "machine" in meta and rows
