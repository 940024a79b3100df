"""The machine line every measured CSV opens with, and the command line beside it."""

from __future__ import annotations

import torch

import nanoserve
from nanoserve.bench.machine import command_line, cpu_model, csv_header, instruction_set, machine_line, read_header


def test_machine_line_names_the_cpu_threads_and_versions():
    line = machine_line()
    assert line.startswith(cpu_model()) and f"| {instruction_set()} |" in line
    assert f"torch threads {torch.get_num_threads()}" in line
    assert f"torch {torch.__version__}" in line and f"nanoserve {nanoserve.__version__}" in line


def test_command_line_is_what_a_user_types():
    assert command_line(["bench", "batch", "--out", "a b.csv"]) == "python -m nanoserve bench batch --out 'a b.csv'"


def test_csv_header_round_trips_through_read_header(tmp_path):
    lines = csv_header("python -m nanoserve bench paged", clock="cpu", threads=1)
    assert lines[0] == "# command: python -m nanoserve bench paged" and lines[1].startswith("# machine: ")
    path = tmp_path / "x.csv"
    path.write_text("\n".join(lines) + "\ncolumn\n1\n")
    meta = read_header(path)
    assert meta["command"] == "python -m nanoserve bench paged" and meta["clock"] == "cpu" and meta["threads"] == "1"
    assert meta["machine"].startswith(cpu_model()) and "load avg" in meta["machine"]
