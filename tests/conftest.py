"""Shared fixtures: a tiny random model for fast tests, the fetched SmolLM2 for real-model tests.

The real checkpoint is fetched and converted on first use (into $NANOSERVE_HOME), so the
suite needs no manual setup step. transformers is imported only here and in tests: it is
the reference implementation, never a runtime dependency.
"""

from __future__ import annotations

import os

import pytest
import torch

from nanoserve.config import ModelConfig
from nanoserve.model import Llama

torch.set_num_threads(max(1, int(os.environ.get("NANOSERVE_THREADS", torch.get_num_threads()))))


@pytest.fixture(scope="session")
def tiny_cfg() -> ModelConfig:
    return ModelConfig.tiny()


@pytest.fixture(scope="session")
def tiny_model(tiny_cfg) -> Llama:
    return Llama.random(tiny_cfg, seed=0)


@pytest.fixture(scope="session")
def model_dir():
    from nanoserve.fetch import ensure_model

    return ensure_model()


@pytest.fixture(scope="session")
def model(model_dir):
    from nanoserve.weights import load_model

    return load_model(model_dir)


@pytest.fixture(scope="session")
def tok(model_dir):
    from nanoserve.tokenizer import Tokenizer

    return Tokenizer.from_folder(model_dir)


@pytest.fixture(scope="session")
def hf_model(model_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def hf_tok(model_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(model_dir)
