"""A model on GGUF blocks or on tiles, stepped by one compiled call (`kernels/csrc/step.cpp`).

`Llama.hidden_states` makes some three hundred small calls per step (norms, views, the backend's writes,
the products' dispatch), each a few microseconds: on the blocks, whose decode step streams a fifth of the fp32
bytes, they add up at batch 1 to as much time as the products, and beside fp32's products to a sixth or so of
a step. `BlockStep` runs the same loops in the same order from C++: the embedding rows, every layer, then the
LM head at each request's last token. Its logits are the Python forward's bit for bit
(tests/model/test_compiled.py); the Python forward stays the definition, and runs wherever this does not apply.

It applies to a model whose every matrix is a `BlockWeight` (`model.gguf_weights`; each takes the product
`linear` gives it, on fp32 or int8 activations) or a matrix with its tiles (`matmul.tiled`, `Llama.pack_weights`:
fp32 on x86 CPUs; bf16, every matrix of a `cast_matrices` model, on AVX512_BF16 ones, or its panels on the other
x86 CPUs, `matmul.panels`, each product then taking and giving bf16 as `linear` does) of a multiple of 16
outputs, with the compiled kernels on; the weights as they are when the step is made (a matrix written later
leaves its tiles behind, and the step with them). And to every step on an fp32 K/V pool: decode tokens, chunks
after a cached context, whole prompts, which the paged kernel computes as it does any row. On a bf16 pool a whole
prompt's attention takes a kernel with bf16 products (`attention.causal.bf16_prompt_attention`): this call takes it
too where the CPU has it (AVX512_BF16); elsewhere that kernel is torch's, and a step holding a whole prompt runs the
Python forward.

Gemma 3's layer (`model.gemma3`) steps the same way on its GGUF blocks with int8 activations on an x86 int8 road
(its Q4_K and Q6_K read as they lie, Q5_0 and Q8_0 from their packed copies, q/k/v row groups of Q5_0 and Q8_0 as
one Q8_0 matrix of the same numbers) and an fp32 K/V pool: QK-norm, four norms a layer, GeGLU, each sliding layer's
window and rope table, and on the hybrid pool (`kv.hybrid`) each layer's KV cache group's slots and block tables.
Its steps are one call each (`decode`'s steps in one call are Llama's).

    >>> step = BlockStep.of(model)                       # None unless on blocks or tiles  # doctest: +SKIP
    >>> logits = step(ids, md, cache.storage)            # (R, V), as ModelRunner.execute's  # doctest: +SKIP
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import kernels
from ..attention.metadata import AttentionMetadata
from ..kernels import int8
from .gemma3 import Gemma3, one_plus
from .llama import Llama
from .matmul import BlockWeight, RowGroups, panels, tiled

NO_PACKED = torch.empty(0, dtype=torch.uint8)  # a matrix read as its blocks are


def applies(md: AttentionMetadata, bf16_pool: bool = False, head_dim: int = 0) -> bool:
    """Whether a step may run compiled: on an fp32 pool always; on a bf16 pool where the compiled kernel with bf16
    products takes whole prompts of heads of `head_dim` (`kernels.prompt_attention_bf16_here`), or when no request
    computes a whole prompt (every one attends over keys already in the cache, which the paged kernel reads where
    they lie)."""
    return not bf16_pool or all(n == 1 or n < s for n, s in zip(md.query_lens, md.seq_lens_host)) or \
        kernels.prompt_attention_bf16_here(head_dim)


def _stepped(w: Tensor | BlockWeight) -> bool:
    """Whether the compiled step multiplies by w: GGUF blocks, or an fp32 or bf16 matrix's tiles, whole tiles
    only (bf16: an even number of inputs, which its tiles take in pairs), or a bf16 matrix's panels."""
    if isinstance(w, BlockWeight):
        return True
    whole = w.shape[0] % 16 == 0 and (w.dtype == torch.float32 or (w.dtype == torch.bfloat16 and w.shape[1] % 2 == 0))
    return (whole and tiled(w) is not None) or panels(w) is not None


def _held(w: Tensor | BlockWeight) -> tuple[Tensor, str, bool, Tensor]:
    """What `BlockModel` reads of a matrix: its blocks or tiles, their format, int8 activations or not, and the
    blocks' packed copy (or none)."""
    if isinstance(w, BlockWeight):
        return w.blocks, w.fmt, w.activations == "int8", p if (p := w.int8_packed()) is not None else NO_PACKED
    if (t := tiled(w)) is not None:
        return t, "f32" if w.dtype == torch.float32 else "bf16", False, NO_PACKED
    return panels(w), "bf16-panels", False, NO_PACKED


def _one_format(w: Tensor | BlockWeight | RowGroups) -> Tensor | BlockWeight | None:
    """A Gemma matrix as one the step reads: itself, or row groups of Q5_0 and Q8_0 on int8 activations as the Q8_0
    blocks of their numbers stacked (`int8.q5_0_as_q8_0`: the int8 product of those is the Q5_0 product, bit for
    bit, and rows do not change each other's); None for other groups."""
    if not isinstance(w, RowGroups):
        return w
    if not all(p.activations == "int8" and p.fmt in ("q5_0", "q8_0") for p in w.parts):
        return None
    rows = [int8.q5_0_as_q8_0(p.blocks) if p.fmt == "q5_0" else p.blocks for p in w.parts]
    return BlockWeight(torch.cat(rows), "q8_0", w.shape[1], "int8")


class BlockStep:
    """The model's weights handed to the compiled `BlockModel` once (checked there), then one call per step."""

    def __init__(self, model: Llama | Gemma3, compiled):
        self.model, self.compiled = model, compiled
        self.gemma = isinstance(model, Gemma3)

    @classmethod
    def of(cls, model: Llama | Gemma3) -> BlockStep | None:
        """The compiled step of `model`, or None where it cannot run: a family whose layer is neither Llama's nor
        Gemma 3's, a matrix neither on blocks nor tiles, bf16 tiles beside others, a residual stream not fp32, or no
        compiled kernels."""
        if isinstance(model, Gemma3):
            return cls._gemma(model)
        if not isinstance(model, Llama):
            return None
        mats = model.matrices()
        if model.dtype != torch.float32 or not kernels.available() or not all(map(_stepped, mats)) \
                or not isinstance(model.embed, BlockWeight | Tensor):
            return None
        weights, fmts, int8, packed = zip(*map(_held, mats))
        bf16 = {f for f in fmts if f.startswith("bf16")}
        if bf16 and set(fmts) != bf16:  # bf16 products take and give bf16: all of them, or none
            return None
        norms = [n for blk in model.layers for n in (blk.attn_norm, blk.mlp_norm)] + [model.norm]
        cfg, embed = model.cfg, model.embed
        blocks = isinstance(embed, BlockWeight)
        if not blocks and embed.dtype not in (torch.float32, torch.bfloat16):
            return None
        compiled = kernels.load().BlockModel(  # type: ignore[union-attr]
            embed.blocks if blocks else embed.detach(),
            embed.fmt if blocks else "f32" if embed.dtype == torch.float32 else "bf16",
            [n.detach().contiguous() for n in norms], list(weights), list(fmts), list(int8), list(packed),
            cfg.n_heads, cfg.n_kv_heads, cfg.rms_norm_eps, model.kv_dtype == torch.bfloat16)
        return cls(model, compiled)

    @classmethod
    def _gemma(cls, model: Gemma3) -> BlockStep | None:
        """Gemma 3 on GGUF blocks with int8 activations, on an x86 int8 road (its Q5_0 is read from the packed copy),
        with an fp32 K/V pool and the query scale of head_dim; None elsewhere (the Python forward runs)."""
        if not kernels.available() or not int8.packed_here() or model.dtype != torch.float32 \
                or model.kv_dtype != torch.float32 or any(b.q_scale is not None for b in model.layers):
            return None
        mats = [_one_format(w) for w in model.matrices()]  # (BlockModel keeps the tensors it is given)
        if not all(isinstance(w, BlockWeight) and w.activations == "int8" for w in mats):
            return None
        fmts = [w.fmt for w in mats]
        packed = [NO_PACKED if f in ("q4_k", "q6_k") else w.int8_packed() for w, f in zip(mats, fmts)]
        if any(p is None for p in packed):
            return None
        norms = [n.contiguous() for b in model.layers for n in one_plus(b, b.NORMS)]
        norms.append(one_plus(model, ("norm",))[0].contiguous())
        cfg = model.cfg
        compiled = kernels.load().BlockModel(  # type: ignore[union-attr]
            model.embed.blocks, model.embed.fmt, norms, [w.blocks for w in mats], fmts, [True] * len(mats), packed,
            cfg.n_heads, cfg.n_kv_heads, cfg.rms_norm_eps, False, [cfg.window(i) or 0 for i in range(cfg.n_layers)],
            float(model.embed_scale))
        return cls(model, compiled)

    def __call__(self, ids: Tensor, md: AttentionMetadata, storage, rows: Tensor | None = None,
                 split_keys: int | None = None, groups: list[AttentionMetadata] | None = None,
                 ) -> tuple[Tensor, Tensor]:
        """Logits (R, V) at `rows` of the step (default each request's last token), as the Python forward gives
        them, and each row's argmax (R,) as `argmax_rows` gives it (found by the step's threads while they hold
        the logits); the step's k/v are written into `storage` (a KVStorage) on the way. Only real tokens are
        computed.
        No inference_mode wrapper: the compiled call records no autograd anyway, and the wrapper's cost would
        show in a decode step."""
        n = md.num_tokens
        rows = md.last_rows if rows is None else rows
        empty = rows.numel() == 0  # nothing to sample (a prompt's middle chunk): the k/v are still written
        top = max(md.seq_lens_host) - 1
        cos, sin = self.model.rope_tables(top)  # (P, D) each, every position of the step
        if ids.numel() > n:  # padding rows: the compiled step computes real tokens only
            ids, positions = ids[:n], md.positions[:n]
        else:
            positions = md.positions
        extra = {}
        if self.gemma:
            extra["cos_local"], extra["sin_local"] = self.model.rope_tables(top, local=True)
        if groups is not None and len(groups) > 1:  # a table per KV cache group; each layer in its group's slot
            extra.update(group_slots=[g.slot_mapping[:n] for g in groups],
                         group_tables=[g.block_tables for g in groups], layer_group=storage.layer_group,
                         layer_slot=storage.layer_slot)
        logits, best = self.compiled.step(
            ids, positions, cos, sin, storage.k, storage.v, md.slot_mapping[:n], md.query_start_loc,
            md.seq_lens, md.block_tables, md.last_rows[:1] if empty else rows, self.model.cfg.head_dim ** -0.5,
            kernels.SPLIT_KEYS if split_keys is None else split_keys, **extra)
        return (logits[:0], best[:0]) if empty else (logits, best)

    def decode(self, ids: Tensor, positions: Tensor, block_tables: Tensor, stop_ids: Tensor, storage,
               steps: int) -> Tensor:
        """Up to `steps` decode steps in one call (`BlockModel::decode`): ids, positions (R,) the first step's tokens,
        one per request, block_tables (R, W) already holding a slot for every step's token, stop_ids (R, S) each
        request's stop tokens (-1 pads); each step's input is the argmax of the one before, and the steps end once
        every request has chosen a stop token. Returns the tokens (steps run, R) that many calls of this step, each
        given the last one's argmax, would choose, bit for bit."""
        cos, sin = self.model.rope_tables(int(positions.max()) + steps - 1)
        return self.compiled.decode(steps, ids, positions, cos, sin, storage.k, storage.v, block_tables, stop_ids,
                                    self.model.cfg.head_dim ** -0.5, kernels.SPLIT_KEYS)[0]
