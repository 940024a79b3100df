"""The notebooks' display helpers: the package's own source shown, never a second copy."""

from __future__ import annotations

import IPython.display
import pytest

from nanoserve.attention import prepare
from nanoserve.bench.machine import machine_line
from nanoserve.model import matmul
from nanoserve.teach.notebook import machine_info, show_cpp, show_source


def shown(monkeypatch, fn, *args) -> str:
    out = []
    monkeypatch.setattr(IPython.display, "display", out.append)
    fn(*args)
    (md,) = out
    return md.data


def test_show_source_shows_the_function_as_python(monkeypatch):
    text = shown(monkeypatch, show_source, prepare)
    assert text.startswith("```python\ndef prepare(chunks") and text.endswith("\n```")


def test_show_source_shows_a_modules_table_by_name_and_names_what_it_lacks(monkeypatch):
    text = shown(monkeypatch, show_source, matmul, "ROADS")
    assert text.startswith("```python\nROADS: dict[str, tuple[Road, ...]] = {") and '"bf16": (' in text
    with pytest.raises(ValueError, match="assigns no 'NOWHERE'"):
        show_source(matmul, "NOWHERE")
    with pytest.raises(TypeError, match="must be a module"):
        show_source(prepare, "ROADS")


def test_show_cpp_shows_one_kernel_function(monkeypatch):
    text = shown(monkeypatch, show_cpp, "silu_mul")
    assert text.startswith("```cpp\n// SwiGLU's middle") and "torch::Tensor silu_mul(" in text


def test_machine_info_is_the_csv_machine_line():
    assert machine_info().split(" | load avg")[0] == machine_line().split(" | load avg")[0]
