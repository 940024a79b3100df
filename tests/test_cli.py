"""The command line: a completion on stdout, one-line errors with exit code 2 on bad input."""

from __future__ import annotations

import subprocess
import sys

import pytest


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nanoserve", *args], capture_output=True, text=True, timeout=300)


def test_generate_greedy_chat(model_dir):
    r = run("generate", "--model", str(model_dir), "--prompt", "What is the capital of France?",
            "--chat", "--max-tokens", "12")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "The capital of France is Paris."


def test_default_model_is_the_fetched_one(model_dir):
    r = run("generate", "--prompt", "1, 2, 3, 4,", "--max-tokens", "8", "--stop", "\n")
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
        (["frobnicate"], "invalid choice"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(args, message):
    r = run(*args)
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.strip().splitlines() if ln]
    assert len(lines) == 1 and message in lines[0], r.stderr
