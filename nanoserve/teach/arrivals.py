"""Pictures of requests arriving and being served (Days 37-39): a trace, and metrics against the offered rate."""

from __future__ import annotations

import math
from collections.abc import Sequence

COLORS = {"nanoserve-engine": "tab:blue", "nanoserve-server": "tab:green", "transformers-cb": "tab:orange",
          "transformers-serve": "tab:red", "llama-server": "tab:purple"}


def draw_trace(ax, times: Sequence[float], title: str = "") -> None:
    """Each arrival as a tick on a time line, and the running count of requests sent."""
    ax.step(list(times), range(1, len(times) + 1), where="post", color="tab:blue")
    ax.plot(list(times), [0.3] * len(times), "|", color="black", markersize=12)
    ax.set_xlabel("seconds")
    ax.set_ylabel("requests sent")
    ax.set_title(title)


def _x(rate: float, finite: Sequence[float]) -> float:
    """Rate infinity (all at once) drawn one step past the highest finite rate."""
    return rate if math.isfinite(rate) else max(finite) * 1.25 if finite else 1.0


def draw_vs_rate(ax, rows: Sequence[dict], key: str, systems: Sequence[str] | None = None, scale: float = 1.0,
                 label: str | None = None, diagonal: bool = False) -> None:
    """One line per system: a summary column (e.g. goodput, ttft_p90) against the offered rate. `diagonal`
    draws goodput = rate, what a system that keeps up would reach."""
    systems = systems or list(dict.fromkeys(r["system"] for r in rows))
    finite = sorted({r["rate"] for r in rows if math.isfinite(r["rate"])})
    for s in systems:
        pts = sorted((_x(r["rate"], finite), r[key] * scale) for r in rows if r["system"] == s)
        ax.plot(*zip(*pts), "o-", color=COLORS.get(s), label=s)
    if diagonal and finite:
        ax.plot(finite, finite, ":", color="gray", label="the offered rate")
    ticks = [_x(r, finite) for r in sorted({r["rate"] for r in rows}, key=lambda r: (math.isinf(r), r))]
    ax.set_xticks(ticks, [f"{t:g}" if math.isfinite(t) else "all at once"
                          for t in sorted({r["rate"] for r in rows}, key=lambda r: (math.isinf(r), r))])
    ax.set_xlabel("offered rate (requests/s)")
    ax.set_ylabel(label or key)
    ax.legend(fontsize=8)
