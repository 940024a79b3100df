"""What every `bench` command shares: `add_arguments(ap)` calls `common_arguments`; `run(args, argv) -> int` calls
`start(args)` first and writes its CSV (`csvio`) under `csv_header(argv, ...)`: the command, the machine, settings."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .. import loader
from ..config import EngineConfig, SchedulerConfig
from ..model import Llama
from ..tokenizer import Tokenizer
from .machine import machine_line

SHARED: dict[str, dict[str, Any]] = {  # options more than one command takes, each command with its own default
    "contexts": dict(type=int, nargs="+", help="prompt lengths (tokens)"),
    "batch_sizes": dict(type=int, nargs="+", help="requests decoding together"),
    "prompt_tokens": dict(type=int, help="the prompt's length (tokens of prose)"),
    "steps": dict(type=int, help="decode steps per run"),
    "repeats": dict(type=int, help="timed calls per point"),
    "rounds": dict(type=int, help="rounds, every configuration once a round; medians are over rounds"),
    "requests": dict(type=int, help="requests in the workload"),
    "rates": dict(type=float, nargs="+", help="arrival rates (requests/s; inf: all at once)"),
    "seed": dict(type=int, help="the workload's seed"),
    "model": dict(help="HF checkpoint folder (default: the fetched SmolLM2)"),
}


def common_arguments(ap: argparse.ArgumentParser, csv_path: str, engine: bool = False, weights: str | None = None,
                     several_kv: bool = False, **shared: Any) -> None:
    """--out, --threads, each SHARED option in `shared` with that default, with `weights` `load`'s flags (that
    --weights default; `several_kv`: --kv-cache-dtype a list), and with `engine` EngineConfig's."""
    ap.add_argument("--out", default=csv_path, help=f"the CSV to write (default: {csv_path})")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    if weights is not None:
        loader.add_cli_arguments(ap, weights, several_kv=several_kv)
        ap.set_defaults(load_flags=True)  # what `start` loads by
    for name, default in shared.items():
        ap.add_argument(f"--{name.replace('_', '-')}", default=default, **SHARED[name])
    if engine:
        EngineConfig.add_cli_arguments(ap)


_started: dict[str, str] = {}  # the machine line as `start` saw it, before the run's own work loaded the machine


def start(args: argparse.Namespace, model: bool = True) -> tuple[Llama, Tokenizer] | None:
    """Set torch's threads if asked, note the machine and its load before the run, warn when other work shares
    the machine, and with `model` load the model (as `load`'s flags ask, where the command has them)."""
    if args.threads:
        torch.set_num_threads(args.threads)
    _started["machine"] = machine_line()
    busy = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    if busy > 0.5 * (os.cpu_count() or 1):
        print(f"warning: load average {busy:.1f} on {os.cpu_count()} cores: other work shares this machine, so "
              "absolute numbers will be low and noisy (same-run ratios less so)", file=sys.stderr)
    if not model:
        return None
    return loader.from_cli(args) if getattr(args, "load_flags", False) else loader.load(getattr(args, "model", None))


def engine_config(config: EngineConfig | SchedulerConfig | argparse.Namespace | None = None) -> EngineConfig:
    """The engine's configuration from a command line, a SchedulerConfig, or None (defaults)."""
    if isinstance(config, argparse.Namespace):
        return EngineConfig.from_cli(config)
    if isinstance(config, SchedulerConfig):
        return EngineConfig(scheduler=config)
    return config if config is not None else EngineConfig()


def engine_argv(args: argparse.Namespace) -> list[str]:
    """The engine's options as this command was given them, for a `serve` subprocess."""
    ap = argparse.ArgumentParser(add_help=False)
    EngineConfig.add_cli_arguments(ap)
    out: list[str] = []
    for action in ap._actions:
        flag, value = action.option_strings[0], getattr(args, action.dest)
        if value is None:  # an option left off (its default is off)
            continue
        out += ([flag] if value else []) if action.nargs == 0 else [flag, str(value)]  # a switch, or an option
    return out


def csv_header(argv: Sequence[str], **extra: Any) -> dict[str, Any]:
    """A measured CSV's header: its command as typed, its machine (its load when `start` ran, not the run's own),
    the run's settings (`extra`)."""
    machine = _started.get("machine") or machine_line()
    return {"command": shlex.join(["python", "-m", "nanoserve", *argv]), "machine": machine, **extra}


def report(out: object, meta: Mapping[str, Any], rows: Sequence[Mapping[str, Any]],
           cols: Sequence[str] | None = None) -> int:
    """Print the header and a table of `rows`, say where the CSV went; exit code 0."""
    print("\n".join(f"{k}: {v}" for k, v in meta.items()))
    print(f"{table(rows, cols)}\n-> {out}")
    return 0


def table(rows: Sequence[Mapping[str, Any]], cols: Sequence[str] | None = None) -> str:
    """Rows as aligned text columns, floats to 4 significant digits."""
    cols = list(cols or (rows[0] if rows else []))
    cells = [[f"{r[c]:.4g}" if isinstance(r[c], float) else str(r[c]) for c in cols] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(cols)]
    return "\n".join("  ".join(v.rjust(w) for v, w in zip(line, widths)) for line in [cols, *cells])
