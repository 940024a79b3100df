"""Loading a checkpoint folder: every failure is a clear error that names the file and tensor."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from nanoserve.config import CheckpointError
from nanoserve.model.weights import hf_state_dict, load_model, save_checkpoint


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


def test_hf_state_dict_splits_the_fused_matrices_back(tiny_model, folder):
    """What save_checkpoint writes is what transformers' names expect: q/k/v and gate/up split again."""
    sd = hf_state_dict(tiny_model)
    cfg = tiny_model.cfg
    blk = tiny_model.layers[1]
    q, k, v = (sd[f"model.layers.1.self_attn.{n}_proj.weight"] for n in "qkv")
    assert q.shape == (cfg.n_heads * cfg.head_dim, cfg.hidden_size) and k.shape == v.shape
    assert torch.equal(torch.cat([q, k, v]), blk.wqkv.detach())
    gate, up = sd["model.layers.1.mlp.gate_proj.weight"], sd["model.layers.1.mlp.up_proj.weight"]
    assert torch.equal(torch.cat([gate, up]), blk.w_gate_up.detach())
    assert "lm_head.weight" not in sd  # tied: the table is stored once
    assert set(load_file(folder / "model.safetensors")) == set(sd)
