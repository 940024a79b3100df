"""Small helpers the notebooks share: show the package's own source, print the machine."""

from __future__ import annotations

import ast
import inspect
from types import ModuleType


def show_source(obj: object, name: str | None = None) -> None:
    """Print an object's source from the package: the notebook never keeps a second copy. With `name`, obj is a
    module and what is shown is its top-level assignment of that name (a table such as `matmul.ROADS`)."""
    if name is None:
        _show(inspect.getsource(obj), "python")  # type: ignore[arg-type]
        return
    if not isinstance(obj, ModuleType):
        raise TypeError(f"show_source(obj, {name!r}): obj must be a module, not {type(obj).__name__}")
    src = inspect.getsource(obj)
    for node in ast.parse(src).body:
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            _show(ast.get_source_segment(src, node) or "", "python")
            return
    raise ValueError(f"{obj.__name__} assigns no {name!r} at its top level")


def show_cpp(name: str, source: str = "kernels") -> None:
    """Print one function of the compiled kernels' C++ source (`kernels.cpp_source`): from csrc/kernels.cpp, or
    the file `source` names ("quant": the block product's quant.cpp, "step": step.cpp, "matmul_bf16": ...)."""
    from ..kernels import cpp_source

    _show(cpp_source(name, f"{source}.cpp"), "cpp")


def _show(src: str, language: str) -> None:
    """Source as a highlighted block in a notebook, as plain text elsewhere."""
    try:
        from IPython.display import Markdown, display

        display(Markdown(f"```{language}\n{src}\n```"))
    except ImportError:
        print(src)


def machine_info() -> str:
    """One line about the versions and the machine, for the first cell of every day."""
    from ..bench.machine import machine_line

    return machine_line()
