"""Each notebook's time in the test summary: nbval runs a notebook's cells as one item each, so the sum of its
items' times (its kernel's start included) is the day's run, and a day that outgrows its minute shows in every
`make test`. Under `-n 2` a notebook shares the machine with the other worker's tests, so these read above a
quiet run's."""

from __future__ import annotations

from collections import defaultdict

_seconds: dict[str, float] = defaultdict(float)


def pytest_runtest_logreport(report) -> None:
    path = report.nodeid.split("::")[0]
    if path.endswith(".ipynb"):
        _seconds[path] += report.duration


def pytest_terminal_summary(terminalreporter) -> None:
    if not _seconds:
        return
    terminalreporter.section("notebook times (the sum of each notebook's cells)")
    for path, s in sorted(_seconds.items()):
        terminalreporter.write_line(f"{s:6.1f} s  {path}{'  (over a minute)' if s > 60 else ''}")
