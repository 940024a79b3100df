"""The GGUF conversion: permutation algebra, idempotence, and an independent reference.

transformers has its own GGUF reader (dequantize + un-permute, written independently of
ours); loading the original GGUF with it must give the same tensors, config and logits as
transformers loading our converted folder.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers

from nanoserve.config import nanoserve_home
from nanoserve.model import fetch
from nanoserve.model.weights import hf_state_dict


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to q/k rows (the operation we undo)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("n_head, rows", [(9, 576), (3, 192), (4, 64)])
def test_unpermute_inverts_llama_cpp(n_head, rows):
    w = np.random.default_rng(0).standard_normal((rows, 5)).astype(np.float32)
    assert np.array_equal(fetch.unpermute_rope_rows(_llama_cpp_permute(w, n_head), n_head), w)
    assert not np.array_equal(_llama_cpp_permute(w, n_head), w)


def test_converted_folder_is_complete_and_verified(model_dir):
    assert fetch.is_complete(model_dir, verify=True)
    names = {p.name for p in model_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json"} <= names
    cfg = json.loads((model_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["num_key_value_heads"] == 3


def test_ensure_model_is_idempotent(model_dir):
    before = (model_dir / "model.safetensors").stat().st_mtime_ns
    assert fetch.ensure_model(model_dir) == model_dir
    assert (model_dir / "model.safetensors").stat().st_mtime_ns == before


def test_tampered_folder_is_not_complete(tmp_path, model_dir):
    copy = tmp_path / "m"
    copy.mkdir()
    for p in model_dir.iterdir():
        if p.name != "model.safetensors":
            (copy / p.name).write_bytes(p.read_bytes())
    assert not fetch.is_complete(copy)  # a file listed in the manifest is missing


def test_bad_gguf_is_a_clear_error(tmp_path):
    with pytest.raises(fetch.FetchError, match="GGUF file not found"):
        fetch.convert_gguf(tmp_path / "missing.gguf", tmp_path / "out")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf at all")
    with pytest.raises(fetch.FetchError, match="not a readable GGUF file"):
        fetch.convert_gguf(junk, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_conversion_matches_transformers_gguf_reader(model, hf_model):
    """Our conversion gives every tensor transformers' own GGUF reader gives, bit for bit, and the
    same config: transformers on the GGUF and transformers on our folder are then the same forward,
    to the last bit of every logit. (How close our forward is to theirs is tests/model/test_llama.py's.)"""
    import accelerate  # noqa: F401  transformers' GGUF loading needs it: its absence is a failure here

    gguf = fetch.download_gguf(nanoserve_home() / "downloads")
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    ).eval()
    ours, theirs = hf_state_dict(model), ref.state_dict()
    assert set(ours) <= set(theirs)
    for name, w in ours.items():
        assert torch.equal(w, theirs[name]), name
    theirs_cfg, ours_cfg = ref.config.to_dict(), hf_model.config.to_dict()
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "rope_parameters",
                "rms_norm_eps", "vocab_size", "tie_word_embeddings", "max_position_embeddings"):
        assert theirs_cfg[key] == ours_cfg[key], key
    ids = torch.tensor([[1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173]])
    with torch.inference_mode():
        assert torch.equal(ref(ids).logits, hf_model(ids).logits)
