"""Fixtures for the server's tests: a random model with SmolLM2's vocabulary and tokenizer (fast steps, real
text in and out) for tests where only the HTTP behaviour matters; test_server.py serves the real SmolLM2."""

from __future__ import annotations

import pytest

from nanoserve.config import ModelConfig
from nanoserve.model import Llama


@pytest.fixture(scope="session")
def vocab_model(tok) -> Llama:
    """Random weights, SmolLM2's vocabulary: a context of 128 and steps of a millisecond or two."""
    return Llama.random(ModelConfig.tiny(vocab_size=tok.vocab_size, max_position_embeddings=128), seed=0)
