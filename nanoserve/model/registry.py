"""Which class runs which architecture: vLLM's `ModelRegistry`, one line per family.

A checkpoint's config.json names its architecture (`"architectures": ["Gemma3ForCausalLM"]`); the registry
maps that name to the family's module under `model/` and its class, imported only when asked for.

>>> ModelRegistry.resolve_model_cls("LlamaForCausalLM").__name__
'Llama'
"""

from __future__ import annotations

import importlib

_MODELS = {  # architecture -> (module under nanoserve.model, class)
    "LlamaForCausalLM": ("llama", "Llama"),
    "Gemma3ForCausalLM": ("gemma3", "Gemma3"),
}


class ModelRegistry:
    """Architecture names -> model classes (vLLM's names for its two questions)."""

    @staticmethod
    def get_supported_archs() -> list[str]:
        return list(_MODELS)

    @staticmethod
    def resolve_model_cls(architecture: str) -> type:
        if architecture not in _MODELS:
            raise ValueError(f"architecture {architecture!r} is not registered; nanoserve runs {', '.join(_MODELS)}")
        module, name = _MODELS[architecture]
        return getattr(importlib.import_module(f"{__package__}.{module}"), name)
