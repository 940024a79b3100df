"""How many threads a step runs on, when other programs share the cores.

A step is hundreds of parallel regions (every product, norm and attention call), and each ends at a
barrier where every worker thread waits for the slowest. On a machine to itself that is cheap. When
another busy process takes one of the cores, one of the step's workers is descheduled for a whole
time slice (milliseconds) at every barrier it is late to, while the others spin waiting for it: a
step can get ten times slower, not the two times its lost core would cost.

`ThreadPolicy` watches how much CPU time the rest of the machine uses (from /proc/stat, less this
process's own) and runs the steps on the cores that are left: all of them when the machine is quiet,
fewer while something else is busy, back to all when it stops. It asks at most every `interval_s`,
between steps, so it costs nothing a step would notice. Where /proc is not there it leaves torch's
thread count alone.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import torch

TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_seconds() -> tuple[float, float] | None:
    """(busy CPU seconds of the whole machine, of this process) since boot; None without /proc."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        with open("/proc/self/stat") as f:
            own = f.read().rsplit(")", 1)[1].split()
    except (OSError, ValueError, IndexError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    busy = sum(fields[:8]) - idle  # user nice system idle iowait irq softirq steal
    return busy / TICKS, (int(own[11]) + int(own[12])) / TICKS  # utime + stime of this process


def usable_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class ThreadPolicy:
    """Sets torch's thread count to the cores other processes leave free, re-checked every `interval_s`.
    `max_threads`: the most it uses (default: every usable core)."""

    def __init__(self, max_threads: int | None = None, interval_s: float = 0.5,
                 clock: Callable[[], float] = time.monotonic,
                 read: Callable[[], tuple[float, float] | None] = cpu_seconds,
                 set_threads: Callable[[int], None] = torch.set_num_threads):
        self.max_threads = max_threads or usable_cores()
        self.interval_s, self.clock, self.read, self.set_threads = interval_s, clock, read, set_threads
        self.threads = self.max_threads
        self.others = 0.0  # cores the rest of the machine used over the last interval
        self._last = (clock(), read())
        set_threads(self.threads)

    def adjust(self) -> int:
        """Look again if the interval has passed; returns the thread count in force."""
        now = self.clock()
        t0, before = self._last
        if now - t0 < self.interval_s:
            return self.threads
        after = self.read()
        self._last = (now, after)
        if before is None or after is None:
            return self.threads
        others = max(0.0, (after[0] - before[0]) - (after[1] - before[1])) / (now - t0)  # cores busy elsewhere
        self.others = others
        want = max(1, min(self.max_threads, self.max_threads - int(others + 0.5)))
        if want != self.threads:
            self.threads = want
            self.set_threads(want)
        return self.threads
