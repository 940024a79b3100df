"""The command line: a completion on stdout, one-line errors with exit code 2 on bad input."""

from __future__ import annotations

import subprocess
import sys

import pytest

from nanoserve.cli import build_parser, main


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nanoserve", *args], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("road", [[], ["--weights", "gguf"], ["--speculative-tokens", "4"]],
                         ids=["fp32", "gguf", "speculative"])
def test_generate_greedy_chat(model_dir, road):
    r = run("generate", "--model", str(model_dir), "--prompt", "What is the capital of France?",
            "--chat", "--max-tokens", "12", "--greedy", *road)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "The capital of France is Paris."


def test_sampling_defaults_to_the_checkpoints_recommendation_and_greedy_is_a_flag(model_dir, capsys):
    """The fetched folder records how its GGUF's own package samples; --greedy is temperature 0. (In this
    process: the tests above run the command as a user does.)"""
    from nanoserve.config import generation_defaults

    def here(*args: str) -> str:
        assert main(list(args)) == 0
        return capsys.readouterr().out

    assert generation_defaults(model_dir)["temperature"] == 0.2
    args = ["generate", "--chat", "--prompt", "Give me three tips for learning to cook.", "--max-tokens", "24"]
    seeded = [here(*args, "--seed", "3") for _ in range(2)]
    assert seeded[0] == seeded[1] and seeded[0].strip()  # sampled, reproducibly with a seed
    greedy = here(*args, "--greedy")
    assert greedy == here(*args, "--temperature", "0") and greedy != seeded[0]


def test_default_model_is_the_fetched_one(model_dir):
    r = run("generate", "--prompt", "1, 2, 3, 4,", "--max-tokens", "8", "--stop", "\n", "--greedy")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(" 5, 6")


@pytest.mark.parametrize(
    "args, message",
    [
        (["generate"], "--prompt"),
        (["generate", "--prompt", "hi", "--temperature", "-1"], "temperature"),
        (["generate", "--prompt", "hi", "--top-p", "0"], "top_p"),
        (["generate", "--prompt", "hi", "--max-tokens", "zero"], "--max-tokens"),
        (["generate", "--prompt", ""], "--prompt is empty"),
        (["generate", "--prompt", "hi", "--model", "/nonexistent/folder"], "checkpoint folder not found"),
        (["generate", "--prompt", "hi", "--stop", ""], "stop"),
        (["generate", "--prompt", "hi", "--weights", "int3"], "--weights"),
        (["frobnicate"], "invalid choice"),
        (["bench"], "<benchmark>"),
        (["bench", "batch", "--sizes", "x"], "--sizes"),
        (["lengths", "-n", "many"], "-n"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(args, message):
    r = run(*args)
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.strip().splitlines() if ln]
    assert len(lines) == 1 and message in lines[0], r.stderr


def test_kernels_command_builds_them_and_says_where(compiled):
    r = run("kernels")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("nanoserve kernels: nanoserve_kernels") and " ready in " in r.stdout


def test_lengths_command_draws_the_committed_distribution(tmp_path):
    out = tmp_path / "lengths.csv"
    r = run("lengths", "-n", "5", "--seed", "3", "--out", str(out))
    assert r.returncode == 0, r.stderr
    lines = out.read_text().splitlines()
    assert lines[0] == f"# command: python -m nanoserve lengths -n 5 --seed 3 --out {out}"
    assert lines[1] == "request,prompt_tokens,output_tokens" and len(lines) == 2 + 5
    assert "5 requests" in r.stdout


@pytest.mark.parametrize("args", [[], ["generate"], ["fetch"], ["kernels"], ["lengths"], ["bench"], ["bench", "decode"],
                                  ["bench", "layout"], ["bench", "paged"], ["bench", "batch"]])
def test_every_command_has_help(args, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args([*args, "--help"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("usage: nanoserve")


def test_the_overview_lists_every_command(capsys):
    """`nanoserve --help` opens with one line per command and per benchmark: none the parser has is left out."""
    ap = build_parser()
    commands = ap._subparsers._group_actions[0].choices
    benches = commands["bench"]._subparsers._group_actions[0].choices
    with pytest.raises(SystemExit):
        ap.parse_args(["--help"])
    listed = {" ".join(line.split()[:2]) if line.split()[0] == "bench" else line.split()[0]
              for line in capsys.readouterr().out.split("Commands:\n\n", 1)[1].split("\n\n", 1)[0].splitlines()}
    assert listed == {c for c in commands if c != "bench"} | {f"bench {b}" for b in benches}


def test_a_bench_hands_its_server_the_same_model_flags():
    """`bench arrivals` starts `serve` with `loader.cli_argv`: the server must load the model the bench was asked
    for (its numbers format included), or a comparison would measure another model than it names."""
    from nanoserve import loader
    from nanoserve.bench import arrivals

    fields = ("model", "weights", "dtype", "activations", "kv_cache_dtype")
    for asked in (["--weights", "gguf", "--activations", "int8", "--kv-cache-dtype", "bfloat16", "--model", "/m"],
                  ["--kv-cache-dtype", "auto", "bfloat16"], ["--dtype", "bfloat16"], []):
        bench = build_parser().parse_args(["bench", "arrivals", *asked])
        for kv in bench.kv_cache_dtype:  # a run per K/V cache dtype, each server with its own
            serve = build_parser().parse_args(["serve", *loader.cli_argv(arrivals.with_kv(bench, kv))])
            assert {f: getattr(serve, f) for f in fields} == {f: getattr(bench, f) for f in fields} | {
                "kv_cache_dtype": kv}
    assert build_parser().parse_args(["bench", "shared"]).weights == "gguf"  # each bench keeps its own default
