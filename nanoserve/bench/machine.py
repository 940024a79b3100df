"""The machine a measurement ran on: the line every CSV under data/ opens with, beside its command."""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

import torch


def cpu_model() -> str:
    """The CPU's model name (from /proc/cpuinfo where there is one)."""
    try:
        names = [ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                 if ln.startswith("model name")]
        if names:
            return names[0]
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
    import nanoserve

    load = " ".join(f"{v:.1f}" for v in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"
    return (f"{cpu_model()} | {instruction_set()} | {os.cpu_count()} cores | torch threads {torch.get_num_threads()}"
            f" | load avg {load} | python {sys.version.split()[0]} | torch {torch.__version__}"
            f" | nanoserve {nanoserve.__version__}")


def command_line(args: Sequence[str]) -> str:
    """The command as a user types it: `python -m nanoserve ...`."""
    return shlex.join(["python", "-m", "nanoserve", *args])


def csv_header(command: str, **extra: object) -> list[str]:
    """The `# key: value` lines a measured CSV opens with: its command, its machine, and any extras."""
    return [f"# command: {command}", f"# machine: {machine_line()}"] + [f"# {k}: {v}" for k, v in extra.items()]


def read_header(path: str | Path) -> dict[str, str]:
    """The `# key: value` lines at the top of a CSV."""
    meta = {}
    for line in Path(path).read_text().splitlines():
        if not line.startswith("#"):
            break
        key, _, value = line.lstrip("# ").partition(": ")
        meta[key] = value
    return meta


def add_common_arguments(ap: argparse.ArgumentParser, csv_path: str) -> None:
    """The arguments every bench command takes: torch's thread count, and where the CSV goes."""
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    ap.add_argument("--out", default=csv_path)


def use_threads(args: argparse.Namespace) -> None:
    """Set torch's thread count if the command was given one."""
    if args.threads:
        torch.set_num_threads(args.threads)
