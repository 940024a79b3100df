"""Gemma 3, the second family (Day 43): what changes from Llama, in one file, on Llama's step forms (`model.ops`:
the compiled kernels where the caller asks, torch's ops otherwise).

Token ids -> embeddings scaled by sqrt(hidden) -> n_layers x (norm, attention, norm, + residual; norm, GeGLU
MLP, norm, + residual) -> norm -> the tied head. Beside Llama's layer:
- every RMSNorm multiplies by (1 + w), and each sublayer's output is normed again before the residual add;
- q and k are RMSNormed per head (QK-norm) before RoPE; scores are scaled by query_pre_attn_scalar^-0.5;
- the layers of `cfg.layer_types` "sliding_attention" see only their last `sliding_window` positions and
  rotate with a base of `rope_local_theta` (10k), the others every position with `rope_theta` (1e6);
- the MLP's gate is gelu (tanh form), not silu.
The KV backend interface is Llama's (`attention.causal`); a sliding layer whose step reaches past its window
asks the backend for the window and refuses, by name, one that cannot honour it.

The GGUF conversion's Gemma bits live here too (`gguf_config`, `gguf_state_dict`, `gguf_tokenizer`): llama.cpp
stores every norm weight as 1 + w and no q/k permutation; its vocabulary is SentencePiece BPE with no merges.

Shapes: B batch, T new tokens, H query heads, K kv heads, D head_dim, C hidden.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor, nn

from .. import kernels
from ..attention.causal import KVBackend, no_cache_backend
from ..config import ModelConfig
from .base import DecoderLM, set_weight
from .gguf_file import gguf_field, hf_tensors
from .matmul import embedding, linear, linear_weight
from .ops import add_rms_norm, gelu_tanh_mul, rope_frequencies, rope_qk


def one_plus(module: nn.Module, names: tuple[str, ...]) -> list[Tensor]:
    """The (1 + w) of `module`'s norm weights `names`, made once and kept until a weight changes (loading writes
    them in place: their version moves) or moves: what the step's norms multiply by, without an add each call.
    An inference tensor keeps no version: one written in place where it lies keeps its old (1 + w)."""
    ws = [getattr(module, n) for n in names]
    key = (names, tuple((w.data_ptr(), None if w.is_inference() else w._version) for w in ws))  # one kept list
    kept = module.__dict__.get("_one_plus")
    if kept is None or kept[0] != key:
        with torch.no_grad():
            kept = (key, [1.0 + w.detach() for w in ws])
        module.__dict__["_one_plus"] = kept
    return kept[1]


def attend(kv: KVBackend, layer: int, q: Tensor, k: Tensor, v: Tensor, window: int | None, seen: int) -> Tensor:
    """The backend's attention for one layer; `seen`: positions the step's last query sees (its position + 1).
    A backend that honours windows gets the window on every step: a request's keys are then read one way whatever
    the other requests of its step reach, so it gets the same bits in any batch. To one that does not, a window
    the step does not reach changes nothing; one it reaches is refused."""
    if window is not None and getattr(kv, "supports_sliding_window", False):
        return kv(layer, q, k, v, window=window)
    if window is None or seen <= window:
        return kv(layer, q, k, v)
    raise NotImplementedError(
        f"{type(kv).__name__} cannot honour a sliding window of {window} positions, and this step reaches "
        f"position {seen - 1}: run Gemma 3 without a cache or on stages.contiguous.KVCache")
    return kv(layer, q, k, v, window=window)


class Gemma3Block(nn.Module):
    """One Gemma 3 decoder layer. q/k/v and gate/up are each one fused matrix, as in Llama's `Block`."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.cfg, self.window = cfg, cfg.window(layer)
        C, D, H, K = cfg.hidden_size, cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
        self.attn_norm, self.post_attn_norm = nn.Parameter(torch.zeros(C)), nn.Parameter(torch.zeros(C))
        self.mlp_norm, self.post_mlp_norm = nn.Parameter(torch.zeros(C)), nn.Parameter(torch.zeros(C))
        self.q_norm, self.k_norm = nn.Parameter(torch.zeros(D)), nn.Parameter(torch.zeros(D))
        self.wqkv = linear_weight((H + 2 * K) * D, C)  # (out, in)
        self.wo = linear_weight(C, H * D)
        self.w_gate_up = linear_weight(2 * cfg.intermediate_size, C)
        self.w_down = linear_weight(C, cfg.intermediate_size)
        self.kv_dtype: torch.dtype | None = None  # K/V rounded to this before attention (None: kept as computed)
        # SDPA scales by D^-0.5; q is pre-scaled when the config asks for another scale (Gemma 3 270M: none)
        self.q_scale = None if cfg.query_pre_attn_scalar in (None, D) else math.sqrt(D / cfg.query_pre_attn_scalar)

    NORMS = ("attn_norm", "post_attn_norm", "mlp_norm", "post_mlp_norm", "q_norm", "k_norm")

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, layer: int, kv: KVBackend, seen: int,
                compiled: bool | None = False) -> Tensor:
        """x (B, T, C) -> (B, T, C): x + norm(attention(norm(x))), then that + norm(mlp(norm(that))). `compiled`:
        the products' road (`linear`: the tiles where the model packed them) and the norms' (`add_rms_norm`: the
        compiled kernel, the residual add in the same pass). A bf16 product's output (`cast_matrices`) is
        widened, exactly, before a norm or GeGLU reads it: every number between the products stays fp32."""
        eps = self.cfg.rms_norm_eps
        s_attn, s_post_attn, s_mlp, s_post_mlp, s_q, s_k = one_plus(self, self.NORMS)
        c = bool(compiled)
        h = self.attention(add_rms_norm(x, None, s_attn, eps, c)[1], cos, sin, layer, kv, seen, compiled, s_q, s_k)
        x, h = add_rms_norm(x, add_rms_norm(h.float(), None, s_post_attn, eps, c)[1], s_mlp, eps, c)
        return x + add_rms_norm(self.mlp(h, compiled).float(), None, s_post_mlp, eps, c)[1]

    def attention(self, h: Tensor, cos: Tensor, sin: Tensor, layer: int, kv: KVBackend, seen: int,
                  compiled: bool | None = False, s_q: Tensor | None = None, s_k: Tensor | None = None) -> Tensor:
        """`s_q`, `s_k`: the QK-norms' (1 + w), where the caller keeps them (`one_plus`)."""
        cfg = self.cfg
        B, T, _ = h.shape
        H, K, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        if s_q is None or s_k is None:
            s_q, s_k = one_plus(self, self.NORMS)[4:]
        c, eps = bool(compiled), cfg.rms_norm_eps
        q, k, v = linear(h, self.wqkv, compiled).float().view(B, T, H + 2 * K, D).split([H, K, K], dim=2)
        q = add_rms_norm(q.contiguous(), None, s_q, eps, c)[1]  # QK-norm, each head's D numbers
        k = add_rms_norm(k.contiguous(), None, s_k, eps, c)[1]
        # (B, T, H, D), (B, T, K, D) x 2; with a bf16 cache (`round_kv`), its numbers, q's too, on every road
        q, k, v = rope_qk(torch.cat([q, k, v], dim=2), cos, sin, H, K, c, self.kv_dtype)
        if self.q_scale is not None:
            q = q * self.q_scale
        out = attend(kv, layer, q, k, v, self.window, seen)  # (B, T, H*D)
        return linear(out.view(B, T, H * D), self.wo, compiled)

    def mlp(self, h: Tensor, compiled: bool | None = False) -> Tensor:
        """GeGLU: gelu_tanh(gate) * up from one product, projected back down. h (B, T, C)."""
        gate_up = linear(h, self.w_gate_up, compiled).float()
        return linear(gelu_tanh_mul(gate_up, bool(compiled)), self.w_down, compiled)


class Gemma3(DecoderLM):
    """Token ids and their positions in, next-token logits out: Llama's interface (`forward`, `hidden_states`,
    `logits`), so the no-cache road and the contiguous cache run it unchanged. fp32, or bf16 matrices and K/V
    (`cast_matrices`)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.architecture != "Gemma3ForCausalLM" or not cfg.tie_word_embeddings:
            raise ValueError(f"Gemma3 takes a tied Gemma3ForCausalLM config, got {cfg.architecture}")
        self.cfg = cfg
        V, C = cfg.vocab_size, cfg.hidden_size
        self.embed = linear_weight(V, C)  # the table and the tied head, stored [in, out] as every head is
        self.layers = nn.ModuleList(Gemma3Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = nn.Parameter(torch.zeros(C))
        self.register_buffer("embed_scale", torch.tensor(math.sqrt(C)), persistent=False)  # fp32, as transformers
        self.register_buffer("inv_freq", rope_frequencies(cfg), persistent=False)  # the full layers'
        self.register_buffer("inv_freq_local", rope_frequencies(cfg, cfg.rope_local_theta), persistent=False)

    @property
    def lm_head(self) -> Tensor:
        return self.embed

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.dtype

    def hidden_states(self, ids: Tensor, positions: Tensor | None = None, kv: KVBackend | None = None,
                      compiled: bool | None = None) -> Tensor:
        """ids (B, T) -> final normed hidden states (B, T, C). `compiled`: the products' road (`linear`), the rest
        torch's ops."""
        if ids.dim() == 1:
            ids = ids[None]
        B, T = ids.shape
        if positions is None:
            positions = torch.arange(T, device=ids.device).expand(B, T)
        kv = kv or no_cache_backend()
        compiled = kernels.resolve(compiled)
        seen = int(positions.max()) + 1
        rope = {None: self.rope(positions), "local": self.rope(positions, local=True)}
        x = embedding(ids, self.embed, self.dtype) * self.embed_scale  # (B, T, C)
        for i, block in enumerate(self.layers):
            cos, sin = rope["local" if block.window else None]  # (B, T, 1, D) each
            x = block(x, cos, sin, i, kv, seen, compiled)
        return add_rms_norm(x, None, one_plus(self, ("norm",))[0], self.cfg.rms_norm_eps, compiled)[1]

    def logits(self, h: Tensor, compiled: bool | None = None) -> Tensor:
        """The tied head: h (..., C) -> fp32 logits (..., V)."""
        return linear(h, self.lm_head, compiled).float()

    def forward(self, ids: Tensor, positions: Tensor | None = None, kv: KVBackend | None = None,
                last_only: bool = False, logit_index: Tensor | None = None, compiled: bool | None = None) -> Tensor:
        """Logits (B, T, V); with `last_only` (B, V) for the last position; with `logit_index` (B,) each row's."""
        h = self.hidden_states(ids, positions, kv, compiled)
        if logit_index is not None:
            h = h[torch.arange(h.shape[0], device=h.device), logit_index]
        elif last_only:
            h = h[:, -1]
        return self.logits(h, compiled)

    @classmethod
    def random(cls, cfg: ModelConfig, seed: int = 0) -> Gemma3:
        """Random weights with sensible scale (norm weights near 0, so their scale near 1): for unit tests."""
        g = torch.Generator().manual_seed(seed)
        model = cls(cfg)
        with torch.no_grad():
            for name, p in model.named_parameters():
                scale = 0.1 if "norm" in name else 1.0 / math.sqrt(p.shape[-1])
                p.copy_(torch.randn(p.shape, generator=g) * scale)
        return model.eval()

    # -- the checkpoint folder: transformers' Gemma3ForCausalLM names ---------------------------------------

    @staticmethod
    def hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
        C, D, I = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size  # noqa: E741
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, C),
                                              "model.norm.weight": (C,)}
        for i in range(cfg.n_layers):
            p = f"model.layers.{i}."
            shapes.update({p + n: (C,) for n in _NORMS.values()})
            shapes.update({p + "self_attn.q_norm.weight": (D,), p + "self_attn.k_norm.weight": (D,),
                           p + "self_attn.q_proj.weight": (cfg.n_heads * D, C),
                           p + "self_attn.k_proj.weight": (cfg.n_kv_heads * D, C),
                           p + "self_attn.v_proj.weight": (cfg.n_kv_heads * D, C),
                           p + "self_attn.o_proj.weight": (C, cfg.n_heads * D),
                           p + "mlp.gate_proj.weight": (I, C), p + "mlp.up_proj.weight": (I, C),
                           p + "mlp.down_proj.weight": (C, I)})
        return shapes

    def load_hf_state(self, sd: dict[str, Tensor]) -> Gemma3:
        """Copy a checkpoint's tensors (transformers' names, `hf_shapes`) in; q/k/v and gate/up concatenated."""
        with torch.no_grad():
            self.embed.copy_(sd["model.embed_tokens.weight"])
            self.norm.copy_(sd["model.norm.weight"])
            for i, blk in enumerate(self.layers):
                p = f"model.layers.{i}."
                for attr, name in _NORMS.items():
                    getattr(blk, attr).copy_(sd[p + name])
                blk.q_norm.copy_(sd[p + "self_attn.q_norm.weight"])
                blk.k_norm.copy_(sd[p + "self_attn.k_norm.weight"])
                blk.wqkv.copy_(torch.cat([sd[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]))
                blk.wo.copy_(sd[p + "self_attn.o_proj.weight"])
                blk.w_gate_up.copy_(torch.cat([sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]]))
                blk.w_down.copy_(sd[p + "mlp.down_proj.weight"])
        return self.eval()


    def place_gguf(self, t) -> None:
        """The GGUF file's tensors (`gguf_weights.Tensors`) in place: its blocks as they lie, q/k/v and gate/up
        stacked by rows (`RowGroups` where v's format is not q's), llama.cpp's 1 + w norms back to w."""
        cfg = self.cfg
        C, D, I, H, K = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size, cfg.n_heads, cfg.n_kv_heads  # noqa: E741
        set_weight(self, "embed", t.matrix(["token_embd.weight"], (cfg.vocab_size, C), "token_embd"))
        self.norm.copy_(norm_from_gguf(t.vector("output_norm.weight")))
        for i, blk in enumerate(self.layers):
            p = f"blk.{i}."
            for attr, name in _GGUF_NORMS.items():
                getattr(blk, attr).copy_(norm_from_gguf(t.vector(p + name + ".weight")))
            set_weight(blk, "wqkv", t.matrix([p + f"attn_{n}.weight" for n in "qkv"], ((H + 2 * K) * D, C),
                                             p + "attn_qkv"))
            set_weight(blk, "wo", t.matrix([p + "attn_output.weight"], (C, H * D), p + "attn_output"))
            set_weight(blk, "w_gate_up", t.matrix([p + "ffn_gate.weight", p + "ffn_up.weight"], (2 * I, C),
                                                  p + "ffn_gate_up"))
            set_weight(blk, "w_down", t.matrix([p + "ffn_down.weight"], (C, I), p + "ffn_down"))


_NORMS = {"attn_norm": "input_layernorm.weight", "post_attn_norm": "post_attention_layernorm.weight",
          "mlp_norm": "pre_feedforward_layernorm.weight", "post_mlp_norm": "post_feedforward_layernorm.weight"}


# -- the GGUF conversion's Gemma bits (`fetch.convert_gguf` calls them) ---------------------------------------

_GGUF_TO_HF = {
    "attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_NORMS = {"attn_norm": "attn_norm", "post_attn_norm": "post_attention_norm", "mlp_norm": "ffn_norm",
               "post_mlp_norm": "post_ffw_norm", "q_norm": "attn_q_norm", "k_norm": "attn_k_norm"}  # ours -> GGUF's
SLIDING_WINDOW_PATTERN = 6  # llama.cpp's and transformers' Gemma 3: five sliding layers, then one full
ROPE_LOCAL_THETA = 10_000.0  # the sliding layers' RoPE base: not in the GGUF, the same in every Gemma 3


def gguf_config(reader) -> ModelConfig:
    """The config a gemma3 GGUF describes; what it leaves out is Gemma 3's constant (the layer pattern, the local
    RoPE base) or llama.cpp's rule (the query scale: head_dim, except 27B's hidden / heads)."""
    a = "gemma3."
    n_layers, n_heads = int(gguf_field(reader, a + "block_count")), int(gguf_field(reader, a + "attention.head_count"))
    hidden = int(gguf_field(reader, a + "embedding_length"))
    head_dim = int(gguf_field(reader, a + "attention.key_length", hidden // n_heads))
    if any(t.name == "output.weight" for t in reader.tensors):
        raise ValueError("a gemma3 GGUF with an untied output.weight is not one nanoserve converts")
    return ModelConfig(
        architecture="Gemma3ForCausalLM",
        vocab_size=len(gguf_field(reader, "tokenizer.ggml.tokens")),
        hidden_size=hidden,
        intermediate_size=int(gguf_field(reader, a + "feed_forward_length")),
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=int(gguf_field(reader, a + "attention.head_count_kv", n_heads)),
        head_dim=head_dim,
        max_position_embeddings=int(gguf_field(reader, a + "context_length")),
        rms_norm_eps=float(np.float32(gguf_field(reader, a + "attention.layer_norm_rms_epsilon"))),
        rope_theta=float(gguf_field(reader, a + "rope.freq_base", 1_000_000.0)),
        rope_local_theta=ROPE_LOCAL_THETA,
        tie_word_embeddings=True,
        bos_token_id=int(gguf_field(reader, "tokenizer.ggml.bos_token_id")),
        eos_token_id=[int(gguf_field(reader, "tokenizer.ggml.eos_token_id"))],
        layer_types=["sliding_attention" if (i + 1) % SLIDING_WINDOW_PATTERN else "full_attention"
                     for i in range(n_layers)],
        sliding_window=int(gguf_field(reader, a + "attention.sliding_window")),
        query_pre_attn_scalar=hidden // n_heads if n_layers == 62 else head_dim,
        hidden_activation="gelu_pytorch_tanh",
    )


def norm_from_gguf(w: Tensor) -> Tensor:
    """A norm weight as transformers holds it: llama.cpp's converter stored 1 + w, the scale the norm multiplies by."""
    return w - 1.0


def gguf_state_dict(reader, cfg: ModelConfig) -> dict[str, Tensor]:
    """Every tensor dequantized to fp32 under transformers' name; llama.cpp's 1 + w norms back to w."""
    sd = {}
    for gguf_name, _, name, w in hf_tensors(reader, _GGUF_TO_HF):
        if name is None or name == "lm_head.weight":
            raise ValueError(f"tensor {gguf_name!r} is not one a Gemma 3 GGUF has")
        w = torch.from_numpy(np.array(w, order="C"))  # a writable copy: the reader's arrays are read-only
        sd[name] = norm_from_gguf(w) if name.endswith("norm.weight") else w
    return sd


def vocabulary_merges(tokens: list[str]) -> list[tuple[str, str]]:
    """BPE merges a vocabulary implies when its file lists none: every split of a token into two tokens, ranked
    by the token's place in the vocabulary (Gemma's is its merge order: its scores fall with the index), longer
    left part first (transformers' `generate_merges` gives the same list)."""
    vocab = set(tokens)
    return [(t[:cut], t[cut:]) for t in tokens for cut in range(len(t) - 1, 0, -1)
            if t[:cut] in vocab and t[cut:] in vocab]


def gguf_tokenizer(reader):
    """A `tokenizers.Tokenizer` for the GGUF's SentencePiece BPE (llama.cpp's "llama" model): spaces as "▁", bytes
    as <0x..> fallback tokens, no prefix space, BOS added; control tokens special, user-defined ones whole."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors

    if (kind := gguf_field(reader, "tokenizer.ggml.model")) != "llama":
        raise ValueError(f"GGUF tokenizer model {kind!r} is not Gemma's SentencePiece ('llama')")
    raw = list(gguf_field(reader, "tokenizer.ggml.tokens"))
    kinds = list(gguf_field(reader, "tokenizer.ggml.token_type"))
    tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in raw]  # runs of spaces, as "▁"s
    unk = raw[int(gguf_field(reader, "tokenizer.ggml.unknown_token_id"))]
    bos = raw[int(gguf_field(reader, "tokenizer.ggml.bos_token_id"))]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=vocabulary_merges(tokens),
                               unk_token=unk, fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    if gguf_field(reader, "tokenizer.ggml.add_bos_token", True):
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokens.index(bos))])
    # llama.cpp's CONTROL (3) tokens are special; its USER_DEFINED (4) ones (newline runs, HTML tags) are matched
    # whole, except the space runs respelled above, which BPE reaches from "▁"
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, kinds) if k == 3])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, r, k in zip(tokens, raw, kinds) if k == 4 and t == r])
    return tok, tokens

