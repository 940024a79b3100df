"""The model config: read from the same config.json transformers reads, refused clearly when it is not a Llama."""

from __future__ import annotations

from pathlib import Path

import pytest

from nanoserve.config import CheckpointError, ModelConfig, nanoserve_home


def test_gqa_heads_must_divide():
    with pytest.raises(CheckpointError, match="not a multiple"):
        ModelConfig.tiny(n_heads=4, n_kv_heads=3)


def test_sizes_must_be_positive():
    with pytest.raises(CheckpointError, match="sizes must be positive"):
        ModelConfig.tiny(n_layers=0)


def test_config_reads_hf_keys_and_llama3_scaling():
    d = ModelConfig.tiny().to_hf_dict()
    d["rope_scaling"] = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    d["eos_token_id"] = [128001, 128008]
    cfg = ModelConfig.from_hf_dict(d)
    assert cfg.rope_scaling["factor"] == 32.0 and cfg.eos_token_id == [128001, 128008]
    d["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
    with pytest.raises(CheckpointError, match="'yarn' is not supported"):
        ModelConfig.from_hf_dict(d)


def test_hf_dict_round_trip():
    cfg = ModelConfig.tiny(tie_word_embeddings=False, eos_token_id=[2, 7])
    assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg
    assert cfg.n_rep == cfg.n_heads // cfg.n_kv_heads and cfg.kv_dim == cfg.n_kv_heads * cfg.head_dim


def test_missing_key_names_the_file_and_key():
    d = ModelConfig.tiny().to_hf_dict()
    del d["hidden_size"]
    with pytest.raises(CheckpointError, match=r"my/config.json: missing key 'hidden_size'"):
        ModelConfig.from_hf_dict(d, source="my/config.json")


def test_real_config_is_smollm2(model_dir):
    cfg = ModelConfig.from_folder(model_dir)
    assert (cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.vocab_size) == (30, 9, 3, 49152)


def test_nanoserve_home_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("NANOSERVE_HOME", str(tmp_path))
    assert nanoserve_home() == tmp_path
    monkeypatch.delenv("NANOSERVE_HOME")
    assert nanoserve_home() == Path.home() / ".cache" / "nanoserve"


def test_generation_defaults_read_the_checkpoints_recommended_sampling(tmp_path):
    from nanoserve.config import generation_defaults

    assert generation_defaults(tmp_path) == {}  # none: OpenAI's defaults hold
    (tmp_path / "generation_config.json").write_text(
        '{"eos_token_id": 2, "do_sample": true, "temperature": 0.6, "top_p": 0.9, "top_k": 40, "max_length": 9}')
    assert generation_defaults(tmp_path) == {"temperature": 0.6, "top_p": 0.9, "top_k": 40}
    (tmp_path / "generation_config.json").write_text('{"do_sample": false, "temperature": 0.6}')
    assert generation_defaults(tmp_path) == {"temperature": 0.0}  # transformers' greedy
    (tmp_path / "generation_config.json").write_text("{oops")
    with pytest.raises(CheckpointError, match="generation_config.json: not valid JSON"):
        generation_defaults(tmp_path)
