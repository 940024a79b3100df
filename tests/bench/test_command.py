"""What every bench command shares: its options, its header, its engine configuration, its table."""

from __future__ import annotations

import argparse

import pytest

from nanoserve.bench import csvio
from nanoserve.bench.command import (
    common_arguments,
    csv_header,
    engine_argv,
    engine_config,
    report,
    start,
    table,
)
from nanoserve.bench.machine import cpu_model
from nanoserve.cli import build_parser
from nanoserve.config import CacheConfig, EngineConfig, SchedulerConfig


def test_the_command_in_the_header_is_what_a_user_types():
    assert csv_header(["bench", "batch", "--out", "a b.csv"])["command"] == (
        "python -m nanoserve bench batch --out 'a b.csv'")


def test_csv_header_round_trips_through_the_csv(tmp_path):
    meta = csv_header(["bench", "paged"], clock="cpu", threads=1)
    assert list(meta)[:2] == ["command", "machine"] and meta["machine"].startswith(cpu_model())
    back, _ = csvio.read_csv(csvio.write_csv(tmp_path / "x.csv", [{"a": 1}], meta))
    assert back == {"command": "python -m nanoserve bench paged", "machine": meta["machine"], "clock": "cpu",
                    "threads": "1"}


def test_the_header_gives_the_load_before_the_run_not_the_runs_own(monkeypatch):
    from nanoserve.bench import command

    monkeypatch.setattr(command, "_started", {})
    monkeypatch.setattr(command, "machine_line", lambda: "cpu | load avg 0.1 0.1 0.1")
    start(argparse.Namespace(threads=None), model=False)
    monkeypatch.setattr(command, "machine_line", lambda: "cpu | load avg 2.0 1.8 1.6")  # the run's own load
    assert csv_header(["bench", "numerics"])["machine"] == "cpu | load avg 0.1 0.1 0.1"


def test_engine_options_have_engine_configs_defaults_and_reach_a_subprocess():
    ap = argparse.ArgumentParser()
    common_arguments(ap, "data/x.csv", engine=True)
    args = ap.parse_args([])
    assert (args.out, args.threads) == ("data/x.csv", None)
    assert engine_config(args) == EngineConfig.from_cli(args)
    assert engine_config(args).scheduler == SchedulerConfig() and engine_config(args).cache == CacheConfig()
    args = ap.parse_args(["--max-num-seqs", "4", "--no-prefix-caching", "--block-size", "32"])
    again = argparse.ArgumentParser()
    EngineConfig.add_cli_arguments(again)
    assert EngineConfig.from_cli(again.parse_args(engine_argv(args))) == engine_config(args)
    assert "--no-prefix-caching" in engine_argv(args) and "--no-prefix-caching" not in engine_argv(ap.parse_args([]))
    assert "--tpot-slo-ms" not in engine_argv(args)  # off unless given
    args = ap.parse_args(["--tpot-slo-ms", "250"])
    assert engine_config(args).scheduler.tpot_slo_ms == 250.0
    assert EngineConfig.from_cli(again.parse_args(engine_argv(args))) == engine_config(args)


def test_engine_config_takes_a_scheduler_config_or_nothing():
    sched = SchedulerConfig(max_num_seqs=3)
    assert engine_config(sched) == EngineConfig(scheduler=sched) and engine_config(None) == EngineConfig()
    config = EngineConfig(cache=CacheConfig(num_blocks=5))
    assert engine_config(config) is config


@pytest.mark.parametrize("what", ["layout", "paged", "batch", "engine", "chunked", "decode", "attention",
                                  "arrivals", "spec", "outputs", "shared"])
def test_every_command_takes_the_common_options(what):
    args = build_parser().parse_args(["bench", what, "--threads", "1", "--out", "x.csv"])
    assert (args.threads, args.out) == (1, "x.csv")
    if what in ("engine", "chunked", "arrivals", "spec"):  # they run the engine: its options, its defaults
        assert engine_config(args) == EngineConfig()


def test_table_aligns_columns_and_report_prints_header_table_and_path(capsys):
    rows = [dict(impl="kernel", ms=0.123456, n=30), dict(impl="gather", ms=12.5, n=5)]
    assert table(rows).splitlines() == ["  impl      ms   n", "kernel  0.1235  30", "gather    12.5   5"]
    assert table(rows, ["n"]).splitlines() == [" n", "30", " 5"]
    assert report("x.csv", {"command": "c"}, rows[:1], ["impl"]) == 0
    assert capsys.readouterr().out.splitlines() == ["command: c", "  impl", "kernel", "-> x.csv"]


def test_start_loads_the_model_the_commands_flags_ask_for(monkeypatch):
    """`load`'s flags where a command takes them (bench arrivals: the format its server and engine run); bench
    decode's own --activations chooses which models it times beside fp32, and `start` loads fp32 for it."""
    from nanoserve import loader

    calls = []
    monkeypatch.setattr(loader, "load", lambda *a, **k: calls.append((a, k)) or ("model", "tok"))
    asked = {"weights": "gguf", "activations": "int8", "kv_cache_dtype": "bfloat16"}
    for argv, want in ((["bench", "decode", "--activations", "int8"], {}),
                       (["bench", "arrivals", "--weights", "gguf", "--activations", "int8", "--kv-cache-dtype",
                         "bfloat16"], asked)):
        calls.clear()
        assert start(build_parser().parse_args(argv)) == ("model", "tok")
        [(args, kwargs)] = calls
        assert args in ((None,), ()) and {k: kwargs[k] for k in want} == want
        assert kwargs.get("weights", "fp32") == want.get("weights", "fp32")
