"""Both halves of `make test` (tests/, then notebooks/) on pytest-xdist workers: each worker, and the notebook
kernels it starts, takes its share of the cores' threads, so that two workers never oversubscribe the machine
(two torch pools of two threads on two cores run each other down by several times)."""

from __future__ import annotations

import os

if os.environ.get("PYTEST_XDIST_WORKER_COUNT") and "NANOSERVE_THREADS" not in os.environ:
    share = max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    os.environ["NANOSERVE_THREADS"] = os.environ["OMP_NUM_THREADS"] = str(share)
