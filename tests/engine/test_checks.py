"""The input checks every engine path shares: what no path could serve is refused up front, saying what and where."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nanoserve.config import ModelConfig
from nanoserve.engine import check_prompt, check_prompts


@pytest.mark.parametrize("prompt, match", [
    ([], "prompt is empty"),
    ("Hello", "prompt is text .* encode it with the tokenizer"),
    (b"Hello", "prompt is text"),
    ([5, 6.0], r"not token ids \(integers\): \[6\.0\]"),
    ([5, True], r"not token ids \(integers\): \[True\]"),
    ([5, 100, -1], r"outside the vocabulary \[0, 100\): \[100, -1\]"),
    ([1] * 16, "prompt has 16 tokens; the model's context is 16, leaving no room to generate"),
])
def test_check_prompt_refuses_what_no_path_can_serve(prompt, match):
    with pytest.raises(ValueError, match=match):
        check_prompt(prompt, max_context=16, vocab_size=100)


def test_check_prompt_takes_integers_of_any_kind():
    check_prompt([1, np.int64(2), torch.tensor(3)], max_context=16, vocab_size=100)
    check_prompt([1] * 15, max_context=16, vocab_size=100)  # exactly one token of room
    with pytest.raises(ValueError, match="leaving room for 2 of the 4 tokens to generate"):
        check_prompt([1] * 14, max_context=16, vocab_size=100, max_tokens=4)


def test_check_prompts_names_the_row():
    cfg = ModelConfig.tiny()
    check_prompts([[1, 2], (3,)], cfg, max_new_tokens=4)
    with pytest.raises(ValueError, match="empty batch"):
        check_prompts([], cfg)
    with pytest.raises(ValueError, match="prompt 1: prompt has token ids outside the vocabulary"):
        check_prompts([[1], [cfg.vocab_size]], cfg)
    with pytest.raises(ValueError, match="need a list of prompts .* got text 'hi'"):
        check_prompts("hi", cfg)
