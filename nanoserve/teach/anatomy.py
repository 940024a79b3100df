"""Looking inside the model (Days 01-06): pure functions that return the numbers the notebooks draw.

Nothing here is on the serving path. Each function answers one question a reader
asks when opening the model up, and returns plain data that a test can pin:

    tensor_inventory(folder)      what is in the checkpoint: name, shape, dtype, bytes
    parameter_counts(inventory)   where the parameters are, grouped by module
    levels_per_block(w)           distinct values per block of 32: the fingerprint of 4-bit quantization
    token_pieces(tok, text)       which slice of the text each token covers
    rope_angles / rope_view       the rotation RoPE applies, per position and frequency
    rotated_dot(q, k, m, n, f)    a query at m against a key at n, after RoPE
    attention_probs, AttentionRecorder   causal grouped-query attention that keeps its maps
    block_parts(block, x, ...)    every intermediate of one decoder block
    residual_stream(model, ids)   the residual stream after every layer
    sublayer_norms(model, ids)    how much attention and the MLP each write into it, per layer

Shapes: B batch, T tokens, H query heads, K kv heads, D head_dim, C hidden, L layers.
"""

from __future__ import annotations

import html
import json
import math
import re
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from ..config import CheckpointError
from ..model import Block, Llama, add_rms_norm, apply_rope, linear, rope_cos_sin, silu_mul
from ..tokenizer import Tokenizer

# ---------------------------------------------------------------- Day 01: the checkpoint on disk

# the order in which one forward pass meets each kind of tensor
MODULE_ORDER = (
    "embed_tokens", "input_layernorm", "q_proj", "k_proj", "v_proj", "o_proj",
    "post_attention_layernorm", "gate_proj", "up_proj", "down_proj", "norm", "lm_head",
)
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
_LAYER = re.compile(r"\.layers\.(\d+)\.")


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as the file describes it; no weights are read."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # safetensors' code: "F32", "BF16", ...
    nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def layer(self) -> int | None:
        m = _LAYER.search(self.name)
        return int(m.group(1)) if m else None

    @property
    def module(self) -> str:
        """'model.layers.3.self_attn.q_proj.weight' -> 'q_proj' (the group of Day 01's bar chart)."""
        parts = self.name.removesuffix(".weight").split(".")
        return parts[-1]


def safetensors_header(path: str | Path) -> dict[str, dict]:
    """The JSON header of a .safetensors file: 8 bytes of length, then {name: {dtype, shape, data_offsets}}."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > path.stat().st_size - 8:
                raise ValueError(f"header length {n} exceeds the file")
            header = json.loads(f.read(n))
    except (OSError, ValueError, struct.error) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise CheckpointError(f"{path}: not a readable safetensors header ({e})") from None
    header.pop("__metadata__", None)
    return header


def _forward_order(info: TensorInfo) -> tuple[int, int, str]:
    layer = -1 if info.module == "embed_tokens" else (info.layer if info.layer is not None else 10**9)
    rank = MODULE_ORDER.index(info.module) if info.module in MODULE_ORDER else len(MODULE_ORDER)
    return layer, rank, info.name


def tensor_inventory(folder: str | Path) -> list[TensorInfo]:
    """Every tensor in a checkpoint folder (single file or sharded), in the order the forward uses them."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = sorted({folder / f for f in json.loads(index.read_text())["weight_map"].values()})
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index ({e!r})") from None
    else:
        files = [folder / "model.safetensors"]
    out = []
    for path in files:
        if not path.is_file():
            raise CheckpointError(f"{path}: not found")
        for name, meta in safetensors_header(path).items():
            try:
                shape, dtype = tuple(int(s) for s in meta["shape"]), meta["dtype"]
                start, end = meta["data_offsets"]
            except (KeyError, TypeError, ValueError) as e:
                raise CheckpointError(f"{path.name}: tensor {name!r} has a malformed header entry ({e!r})") from None
            if dtype in _DTYPE_BYTES and end - start != math.prod(shape) * _DTYPE_BYTES[dtype]:
                raise CheckpointError(f"{path.name}: tensor {name!r} holds {end - start} bytes, its shape needs "
                                      f"{math.prod(shape) * _DTYPE_BYTES[dtype]}")
            out.append(TensorInfo(name, shape, dtype, end - start))
    return sorted(out, key=_forward_order)


def parameter_counts(inventory: Iterable[TensorInfo]) -> dict[str, int]:
    """Parameters per module kind, summed over layers, in forward order: {'embed_tokens': 28311552, ...}."""
    counts: dict[str, int] = {}
    for t in sorted(inventory, key=lambda t: _forward_order(t)[1:]):
        counts[t.module] = counts.get(t.module, 0) + t.numel
    return counts


def levels_per_block(w: Tensor, block: int = 32) -> Tensor:
    """Distinct values in each run of `block` weights along a row. w (R, N) -> (R, N // block).

    GGUF's Q4_1 stores each block of 32 as 4-bit codes plus a scale and an offset, so a weight
    that went through it takes at most 16 values per block, even after dequantizing to fp32.
    """
    if w.dim() != 2 or w.shape[1] % block:
        raise ValueError(f"expected a (rows, n * {block}) matrix, got shape {tuple(w.shape)}")
    b = w.reshape(w.shape[0], -1, block).sort(dim=-1).values  # (R, N/block, block)
    return 1 + (b[..., 1:] != b[..., :-1]).sum(-1)


# ---------------------------------------------------------------- Day 02: tokens


@dataclass(frozen=True)
class Piece:
    id: int
    text: str  # the characters of the input this token covers
    token: str  # the vocabulary entry (byte-level: 'Ġ' is a space)
    whole: bool  # False when the token holds only some bytes of a character


def token_pieces(tok: Tokenizer, text: str) -> list[Piece]:
    """Each token of `text` with the slice it covers; a character split over tokens shows up in each of them."""
    return [Piece(i, s, tok.id_to_token(i) or "", "\ufffd" not in tok.decode([i])) for i, s in tok.pieces(text)]


def _visible(s: str) -> str:
    return s.replace(" ", "·").replace("\n", "↵").replace("\t", "→")


def format_pieces(pieces: Sequence[Piece]) -> str:
    """One line, tokens separated by '|', spaces as '·', newlines as '↵'; a part-character token in [brackets]."""
    return "|".join(_visible(p.text) if p.whole else f"[{_visible(p.text)}]" for p in pieces)


def pieces_html(pieces: Sequence[Piece]) -> str:
    """The same, as coloured boxes with the id on hover: what Day 02's text box shows."""
    colours = ("#cfe8ff", "#ffe3c2", "#d8f5d0", "#f3d6f5")
    spans = [
        f'<span title="id {p.id}" style="background:{colours[i % 4]};padding:1px 2px;margin:1px;'
        f'border-radius:3px;font-family:monospace;{"" if p.whole else "border:1px dashed #c00;"}">'
        f"{html.escape(_visible(p.text))}</span>"
        for i, p in enumerate(pieces)
    ]
    return f"<div>{''.join(spans)}</div><div>{len(pieces)} tokens</div>"


# ---------------------------------------------------------------- Day 04: rotary positions


def rope_angles(inv_freq: Tensor, positions: Sequence[int] | Tensor) -> Tensor:
    """Rotation angle in radians of every (position, pair): (T, D/2) = position * inv_freq."""
    pos = torch.as_tensor(positions, dtype=torch.float64)
    return pos[:, None] * inv_freq.double()[None, :]


@dataclass(frozen=True)
class RopeView:
    """What RoPE does to one pair of coordinates at one position (Day 04's slider)."""

    position: int
    pair: int
    radians_per_token: float
    wavelength: float  # tokens for one full turn
    angle: float  # radians, wrapped into [0, 2*pi)
    cos: float
    sin: float
    trail: list[tuple[float, float]]  # where the unit vector (1, 0) lands at the last few positions


def rope_view(inv_freq: Tensor, position: int, pair: int, trail: int = 24) -> RopeView:
    if not 0 <= pair < len(inv_freq):
        raise ValueError(f"pair must be in [0, {len(inv_freq)}), got {pair}")
    if position < 0:
        raise ValueError(f"position must be >= 0, got {position}")
    w = float(inv_freq[pair])
    pos = range(max(0, position - trail + 1), position + 1)
    angle = math.fmod(position * w, 2 * math.pi)
    return RopeView(position, pair, w, 2 * math.pi / w, angle, math.cos(angle), math.sin(angle),
                    [(math.cos(p * w), math.sin(p * w)) for p in pos])


def rotated_dot(q: Tensor, k: Tensor, m: int, n: int, inv_freq: Tensor) -> float:
    """q (D,) rotated to position m, dotted with k (D,) rotated to position n, with the model's own RoPE."""
    cos, sin = rope_cos_sin(inv_freq, torch.tensor([[m, n]]))  # (1, 2, 1, D)
    x = torch.stack([q, k])[None, :, None, :].to(cos.dtype)  # (1, 2, 1, D)
    r = apply_rope(x, cos, sin)[0, :, 0]  # (2, D)
    return float(r[0] @ r[1])


# ---------------------------------------------------------------- Day 05: attention


def repeat_kv(x: Tensor, n_rep: int) -> Tensor:
    """(B, T, K, D) -> (B, T, K*n_rep, D): query head h reads kv head h // n_rep."""
    return x.repeat_interleave(n_rep, dim=2)


def attention_probs(q: Tensor, k: Tensor) -> Tensor:
    """Causal softmax(q k^T / sqrt(D)) per query head, in fp32. q (B, T, H, D), k (B, T, K, D) -> (B, H, T, T)."""
    B, T, H, D = q.shape
    kh = repeat_kv(k, H // k.shape[2])  # (B, T, H, D)
    scores = torch.einsum("bthd,bshd->bhts", q.float(), kh.float()) / math.sqrt(D)  # (B, H, T, T)
    future = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
    return scores.masked_fill(future, float("-inf")).softmax(-1)


class AttentionRecorder:
    """A KV backend that computes causal grouped-query attention by hand and keeps each head's map.

    >>> rec = AttentionRecorder(layers=[0, 5])      # doctest: +SKIP
    >>> logits = model(ids, kv=rec)                 # doctest: +SKIP
    >>> rec.probs[5].shape                          # (B, H, T, T)  # doctest: +SKIP
    """

    def __init__(self, layers: Iterable[int] | None = None):
        self.layers = None if layers is None else set(layers)
        self.probs: dict[int, Tensor] = {}

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        B, T, H, D = q.shape
        p = attention_probs(q, k)  # (B, H, T, T)
        if self.layers is None or layer in self.layers:
            self.probs[layer] = p.detach().clone()
        vh = repeat_kv(v, H // v.shape[2]).transpose(1, 2)  # (B, H, T, D)
        out = p.to(v.dtype) @ vh  # (B, H, T, D)
        return out.transpose(1, 2).reshape(B, T, H * D)


# ---------------------------------------------------------------- Day 06: the block and the residual stream


def block_parts(block: Block, x: Tensor, cos: Tensor, sin: Tensor, layer: int, kv,
                compiled: bool = False) -> dict[str, Tensor]:
    """Block.forward one sublayer at a time, keeping what each step makes; 'out' is block(x, ...) bit
    for bit (the same calls). The MLP's gate, up and act are shown from its first product. x (B, T, C)."""
    eps = block.cfg.rms_norm_eps
    p: dict[str, Tensor] = {"x": x}
    _, p["attn_in"] = add_rms_norm(x, None, block.attn_norm, eps, compiled)
    p["attn_out"] = block.attention(p["attn_in"], cos, sin, layer, kv, compiled)  # (B, T, C): what attention adds
    p["mid"], p["mlp_in"] = add_rms_norm(x, p["attn_out"], block.mlp_norm, eps, compiled)
    gate_up = linear(p["mlp_in"], block.w_gate_up, compiled)
    p["gate"], p["up"] = gate_up.chunk(2, dim=-1)  # (B, T, I) each
    p["act"] = silu_mul(gate_up, compiled)  # SwiGLU: silu(gate) * up
    p["mlp_out"] = block.mlp(p["mlp_in"], compiled)  # (B, T, C): what the MLP adds
    p["out"] = p["mid"] + p["mlp_out"]
    return p


@torch.inference_mode()
def residual_stream(model: Llama, ids: Sequence[int] | Tensor) -> Tensor:
    """The residual stream of one sequence: embeddings, then after each of the L blocks. -> (L+1, T, C)."""
    ids = torch.as_tensor(ids).reshape(1, -1)  # (1, T)
    states = [F.embedding(ids, model.embed)[0]]
    model.hidden_states(ids, on_layer=lambda i, x: states.append(x[0].clone()))
    return torch.stack(states)


@torch.inference_mode()
def sublayer_norms(model: Llama, ids: Sequence[int] | Tensor) -> dict[str, Tensor]:
    """Per layer, the L2 norm of what attention and the MLP each write into the stream. Each (L, T)."""
    ids = torch.as_tensor(ids).reshape(1, -1)
    T = ids.shape[1]
    cos, sin = rope_cos_sin(model.inv_freq, torch.arange(T)[None])
    x = F.embedding(ids, model.embed)  # (1, T, C)
    attn, mlp = [], []
    for i, blk in enumerate(model.layers):
        p = block_parts(blk, x, cos.to(x.dtype), sin.to(x.dtype), i, AttentionRecorder(layers=[]))
        attn.append(p["attn_out"][0].norm(dim=-1))
        mlp.append(p["mlp_out"][0].norm(dim=-1))
        x = p["out"]
    return {"attn": torch.stack(attn), "mlp": torch.stack(mlp)}
