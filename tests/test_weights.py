"""Loading a checkpoint folder: every failure is a clear error that names the file and tensor."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from nanoserve.config import CheckpointError, ModelConfig
from nanoserve.weights import load_model, save_checkpoint


@pytest.fixture
def folder(tmp_path, tiny_model):
    return save_checkpoint(tiny_model, tmp_path / "ckpt")


def test_missing_folder(tmp_path):
    with pytest.raises(CheckpointError, match="checkpoint folder not found"):
        load_model(tmp_path / "nope")


def test_missing_config(folder):
    (folder / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"config\.json not found"):
        load_model(folder)


def test_corrupt_config(folder):
    (folder / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_model(folder)


def test_unsupported_architecture(folder):
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="unsupported architecture 'GPT2LMHeadModel'"):
        load_model(folder)


def test_missing_weights_file(folder):
    (folder / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"model\.safetensors: not found"):
        load_model(folder)


def test_corrupt_weights_file(folder):
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_model(folder)


def test_missing_tensor_named(folder):
    sd = load_file(folder / "model.safetensors")
    del sd["model.layers.1.mlp.up_proj.weight"]
    save_file(sd, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"'model\.layers\.1\.mlp\.up_proj\.weight' is missing"):
        load_model(folder)


def test_misshapen_tensor_named(folder):
    sd = load_file(folder / "model.safetensors")
    sd["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(3, 3)
    save_file(sd, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"k_proj\.weight' has shape \(3, 3\), config says \(32, 64\)"):
        load_model(folder)


def test_sharded_checkpoint(folder, tiny_model):
    sd = load_file(folder / "model.safetensors")
    names = sorted(sd)
    half = len(names) // 2
    shards = {"a.safetensors": names[:half], "b.safetensors": names[half:]}
    for fname, keys in shards.items():
        save_file({k: sd[k] for k in keys}, str(folder / fname))
    (folder / "model.safetensors").unlink()
    index = {"weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    again = load_model(folder)
    assert all(torch.equal(a, b) for a, b in zip(tiny_model.parameters(), again.parameters()))


def test_gqa_heads_must_divide():
    with pytest.raises(CheckpointError, match="not a multiple"):
        ModelConfig.tiny(n_heads=4, n_kv_heads=3)


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
