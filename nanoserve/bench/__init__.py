"""Instruments: stdlib cores with the clock injected (`timing`, `batchbench`, `serving`, `csvio`), the machine's
limits (`roofline`, `machine`), the profiler, the `harness`, and the `bench` commands. The engine never imports them."""
