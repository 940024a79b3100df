"""Instruments: the stdlib cores with the clock injected (`timing`, `batchbench`, `serving`, and `csvio`, the one
CSV format), the machine's limits (`roofline`, `machine`), the per-op profiler (`profile`), the harness that stands
up the real model (`harness`), and the `python -m nanoserve bench ...` commands, one module each, sharing one shape
(`command`). They import the engine; the engine never imports them."""
