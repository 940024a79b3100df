"""The machine a measurement ran on: the line every CSV under data/ carries beside its command."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import sys
from pathlib import Path

import torch


def cpu_model() -> str:
    """The CPU's model name (from /proc/cpuinfo where there is one)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def instruction_set() -> str:
    """The widest vector unit torch dispatches to here (AVX512, AVX2, ...)."""
    try:
        return torch.backends.cpu.get_cpu_capability()
    except (AttributeError, RuntimeError):
        return "unknown"


def machine_line() -> str:
    """CPU model, instruction set, cores and threads, versions, and the load when the run started."""
    load = " ".join(f"{v:.1f}" for v in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"
    try:  # the installed distribution's, so that the instruments need not import the package above them
        version = importlib.metadata.version("nanoserve")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return (f"{cpu_model()} | {instruction_set()} | {os.cpu_count()} cores | torch threads {torch.get_num_threads()}"
            f" | load avg {load} | python {sys.version.split()[0]} | torch {torch.__version__} | nanoserve {version}")
