"""The machine line every measured CSV carries beside its command."""

from __future__ import annotations

import torch

import nanoserve
from nanoserve.bench.machine import cpu_model, instruction_set, machine_line


def test_machine_line_names_the_cpu_threads_and_versions():
    line = machine_line()
    assert line.startswith(cpu_model()) and f"| {instruction_set()} |" in line
    assert f"torch threads {torch.get_num_threads()}" in line and "load avg" in line
    assert f"torch {torch.__version__}" in line and f"nanoserve {nanoserve.__version__}" in line
