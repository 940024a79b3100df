"""Load (and save) a Hugging Face Llama checkpoint folder with safetensors.

Never `torch.load`: a pickle can run code, a safetensors file is only tensors.
Every tensor is checked for presence and shape against the config, and a
problem is reported with the file and the tensor's name.

The HF layout keeps q, k, v and gate, up as separate matrices; nanoserve
concatenates each group into one matrix at load time, so a decode step reads
those weights in one call (Day 11 measures why that matters).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ..config import CheckpointError, ModelConfig
from .llama import Llama
from .registry import ModelRegistry


def _hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    C, D, F = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (cfg.vocab_size, C),
        "model.norm.weight": (C,),
    }
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, C)
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (C,),
            p + "post_attention_layernorm.weight": (C,),
            p + "self_attn.q_proj.weight": (cfg.n_heads * D, C),
            p + "self_attn.k_proj.weight": (cfg.n_kv_heads * D, C),
            p + "self_attn.v_proj.weight": (cfg.n_kv_heads * D, C),
            p + "self_attn.o_proj.weight": (C, cfg.n_heads * D),
            p + "mlp.gate_proj.weight": (F, C),
            p + "mlp.up_proj.weight": (F, C),
            p + "mlp.down_proj.weight": (C, F),
        })
    return shapes


def _tensor_files(folder: Path) -> dict[str, Path]:
    """Which .safetensors file holds each tensor (single file or a sharded index)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from None
        return {name: folder / fname for name, fname in weight_map.items()}
    single = folder / "model.safetensors"
    if not single.is_file():
        raise CheckpointError(f"{single}: not found (and no model.safetensors.index.json)")
    try:
        with safe_open(single, "pt") as f:
            return {name: single for name in f.keys()}
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{single}: not a readable safetensors file ({e})") from None


def load_state(folder: str | Path, cfg: ModelConfig,
               shapes: dict[str, tuple[int, ...]] | None = None) -> dict[str, torch.Tensor]:
    """Every tensor the config calls for (`shapes`: a family's names and shapes; default Llama's), by HF name,
    shape-checked."""
    folder = Path(folder)
    files = _tensor_files(folder)
    out: dict[str, torch.Tensor] = {}
    handles: dict[Path, object] = {}
    try:
        for name, shape in (shapes or _hf_shapes(cfg)).items():
            if name not in files:
                raise CheckpointError(f"{folder}: tensor {name!r} is missing from the checkpoint")
            path = files[name]
            if path not in handles:
                if not path.is_file():
                    raise CheckpointError(f"{path}: shard listed in the index is missing")
                handles[path] = safe_open(path, "pt")
            t = handles[path].get_tensor(name)  # type: ignore[attr-defined]
            if tuple(t.shape) != shape:
                raise CheckpointError(
                    f"{path.name}: tensor {name!r} has shape {tuple(t.shape)}, config says {shape}"
                )
            out[name] = t
    except SafetensorError as e:
        raise CheckpointError(f"{folder}: corrupt safetensors data ({e})") from None
    return out


def load_model(
    folder: str | Path, dtype: torch.dtype = torch.float32, cfg: ModelConfig | None = None, pack: bool = True,
) -> Llama:
    """The model of the folder's architecture (`ModelRegistry`) with its weights, in eval mode. A `Llama` with
    `pack` also gets oneDNN's blocked copies of its matrices (`Llama.pack_weights`: faster, the weights' memory
    again); `dtype` bfloat16 holds its matrices and K/V in bf16 (`cast_matrices`), the rest in fp32.
    Another family reads its own tensor names (`hf_shapes`, `load_hf_state`).

    >>> model = load_model(fetch.default_model_dir())   # doctest: +SKIP
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: checkpoint folder not found")
    cfg = cfg or ModelConfig.from_folder(folder)
    cls = ModelRegistry.resolve_model_cls(cfg.architecture)
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"dtype={dtype}: expected torch.float32 or torch.bfloat16")
    if cls is not Llama:
        model = cls(cfg).load_hf_state(load_state(folder, cfg, cls.hf_shapes(cfg)))
        if dtype != torch.float32:
            model.cast_matrices(dtype)
        if pack:
            model.pack_weights()
        return model
    sd = load_state(folder, cfg)
    model = Llama(cfg)
    with torch.no_grad():
        model.embed.copy_(sd["model.embed_tokens.weight"])
        model.norm.copy_(sd["model.norm.weight"])
        if not cfg.tie_word_embeddings:
            model.lm_head.copy_(sd["lm_head.weight"])
        for i, blk in enumerate(model.layers):
            p = f"model.layers.{i}."
            blk.attn_norm.copy_(sd[p + "input_layernorm.weight"])
            blk.mlp_norm.copy_(sd[p + "post_attention_layernorm.weight"])
            blk.wqkv.copy_(torch.cat([sd[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]))
            blk.wo.copy_(sd[p + "self_attn.o_proj.weight"])
            blk.w_gate_up.copy_(torch.cat([sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]]))
            blk.w_down.copy_(sd[p + "mlp.down_proj.weight"])
    model = model.eval() if dtype == torch.float32 else model.cast_matrices(dtype).eval()
    if pack:
        model.pack_weights()
    return model


def hf_state_dict(model: Llama) -> dict[str, torch.Tensor]:
    """The model's weights under HF names, split back into q/k/v and gate/up."""
    cfg = model.cfg
    H, K, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    sd = {"model.embed_tokens.weight": model.embed, "model.norm.weight": model.norm}
    if not cfg.tie_word_embeddings:
        sd["lm_head.weight"] = model.lm_head
    for i, blk in enumerate(model.layers):
        p = f"model.layers.{i}."
        q, k, v = blk.wqkv.split([H * D, K * D, K * D])
        gate, up = blk.w_gate_up.chunk(2)
        sd.update({
            p + "input_layernorm.weight": blk.attn_norm,
            p + "post_attention_layernorm.weight": blk.mlp_norm,
            p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k,
            p + "self_attn.v_proj.weight": v, p + "self_attn.o_proj.weight": blk.wo,
            p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up,
            p + "mlp.down_proj.weight": blk.w_down,
        })
    return {k: v.detach().contiguous().clone() for k, v in sd.items()}


def save_checkpoint(model: Llama, folder: str | Path) -> Path:
    """Write config.json + model.safetensors that both nanoserve and transformers load."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(model.cfg.to_hf_dict(), indent=2))
    save_file(hf_state_dict(model), str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder
