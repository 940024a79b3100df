"""A measured CSV under data/: `# key: value` lines (the command, the machine, the run's settings), then a table.
Every bench command writes and reads its CSV here: one header format, one parser. Stdlib only."""

from __future__ import annotations

import csv
import dataclasses
import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any


def write_csv(path: str | Path, rows: Iterable[Mapping[str, Any] | Any], meta: Mapping[str, Any] | None = None,
              fields: Sequence[str] | None = None) -> Path:
    """`meta` as `# key: value` lines (text as it is, the rest as JSON), then `rows` (dicts or dataclasses) under
    `fields` (default: the first row's keys; a missing field is left empty). Makes the folder."""
    rows = [dataclasses.asdict(r) if dataclasses.is_dataclass(r) else r for r in rows]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        for key, value in (meta or {}).items():
            text = value if isinstance(value, str) else json.dumps(value)
            f.write(f"# {key}: {' '.join(text.splitlines())}\n")
        writer = csv.DictWriter(f, list(fields or (rows[0] if rows else [])), lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
    return path


def read_csv(path: str | Path, parse: bool = False) -> tuple[dict[str, str], list[dict[str, Any]]]:
    """The `# key: value` lines above the table (values as text) and its rows, with `parse` numbers parsed."""
    meta: dict[str, str] = {}
    lines: list[str] = []
    with open(path, newline="") as f:
        for line in f:
            if line.startswith("#") and not lines:
                key, _, value = line[1:].strip().partition(": ")
                meta[key] = value
            elif line.strip():
                lines.append(line)
    rows = list(csv.DictReader(lines))
    return meta, [{k: number(v) for k, v in r.items()} for r in rows] if parse else rows


def number(text: str) -> int | float | str | None:
    """'3' -> 3, '0.25' -> 0.25, 'inf' -> inf, '' -> None; other text stays text."""
    if text == "":
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def decoded(meta: Mapping[str, str]) -> dict[str, Any]:
    """Header values JSON-decoded where they are JSON (numbers, lists, true, null), the rest as text."""
    out: dict[str, Any] = {}
    for key, value in meta.items():
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def beside(path: str | Path, name: str) -> Path:
    """A second table written beside a CSV: data/x.csv, "requests" -> data/x-requests.csv."""
    path = Path(path)
    return path.with_name(f"{path.stem}-{name}{path.suffix}")


def records(cls: type, rows: Iterable[Mapping[str, str]]) -> list:
    """Text rows as dataclass `cls`, fields cast by annotation; a column an older CSV lacks takes the default."""
    casts = {"str": str, "int": int, "float": float, "bool": lambda v: v in ("1", "true", "True")}
    fields = [f for f in dataclasses.fields(cls) if f.init]
    return [cls(**{f.name: casts[str(f.type)](r[f.name]) for f in fields if r.get(f.name) is not None})
            for r in rows]
