"""The GGUF conversion: permutation algebra, idempotence, and an independent reference.

transformers has its own GGUF reader (dequantize + un-permute, written independently of
ours); loading the original GGUF with it must give the same logits as our converted folder.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from nanoserve import fetch


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


def test_conversion_matches_transformers_gguf_reader(model):
    """Our conversion gives every tensor transformers' own GGUF reader gives, bit for bit; the
    logits then differ only by the two fp32 kernel stacks' rounding, held to test_model's bounds
    (2e-4 at every position, 1e-4 at the last: measured 1.2e-4 / 0.85e-4 on an AVX2 CPU)."""
    from nanoserve.weights import hf_state_dict

    pytest.importorskip("accelerate")
    transformers = pytest.importorskip("transformers")
    gguf = fetch.download_gguf(fetch.nanoserve_home() / "downloads")
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    ).eval()
    ours, theirs = hf_state_dict(model), ref.state_dict()
    assert set(ours) <= set(theirs)
    for name, w in ours.items():
        assert torch.equal(w, theirs[name]), name
    ids = torch.tensor([[1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173]])
    with torch.no_grad():
        diff = (model(ids) - ref(ids).logits).abs()
    assert diff.max().item() < 2e-4
    assert diff[:, -1].max().item() < 1e-4
