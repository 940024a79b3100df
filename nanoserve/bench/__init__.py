"""Instruments: the stdlib timing core (`timing`, `batchbench`), the machine's limits (`roofline`,
`machine`), the per-op profiler (`profile`), the harness that stands up the real model for them
(`harness`), and the benchmark commands (`single`, `paged`, `batch`: `python -m nanoserve bench ...`).
They import the engine; the engine never imports them."""
