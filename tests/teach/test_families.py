"""Day 43's helpers: config rows, parameters by part, and each layer's attention span."""

import pytest

from nanoserve.config import ModelConfig
from nanoserve.model import Llama
from nanoserve.model.gemma3 import Gemma3
from nanoserve.teach.families import attention_spans, config_rows, parameter_split


def test_config_rows_name_the_window_where_a_family_has_one():
    rows = dict((r[0], r[1:]) for r in config_rows({"llama": ModelConfig.tiny(), "gemma": ModelConfig.tiny_gemma3()}))
    assert rows["KV heads"] == ("2", "1") and rows["sliding layers"] == ("0", "2")
    assert rows["window"] == ("-", "8") and rows["local RoPE base"] == ("-", "10000.0")


@pytest.mark.parametrize("model", [Llama.random(ModelConfig.tiny()), Gemma3.random(ModelConfig.tiny_gemma3())])
def test_parameter_split_counts_every_parameter_once(model):
    parts = parameter_split(model)
    assert sum(parts.values()) == sum(p.numel() for p in model.parameters())
    cfg = model.cfg
    assert parts["embedding"] == cfg.vocab_size * cfg.hidden_size  # tied: the head is the table
    assert all(v > 0 for v in parts.values())


def test_attention_spans_follow_the_window():
    cfg = ModelConfig.tiny_gemma3()  # sliding, sliding, full; window 8
    assert attention_spans(cfg, 3) == [(0, 3)] * 3
    assert attention_spans(cfg, 20) == [(13, 20), (13, 20), (0, 20)]
    assert attention_spans(ModelConfig.tiny(), 20) == [(0, 20)] * ModelConfig.tiny().n_layers
    with pytest.raises(ValueError, match="position"):
        attention_spans(cfg, -1)
