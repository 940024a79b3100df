"""What every family's model shares: its matrices, whatever holds them, and the questions asked of them.

A family (`llama`, `gemma3`) writes its layer and its forward; this base answers, the same way for each, which
matrices a product multiplies, what holds them (fp32 or bf16 tensors, GGUF blocks, row groups of blocks), how
many bytes a decode step streams, and the layouts `linear` reads (`pack_weights`). Each layer holds the four
matrices `wqkv`, `wo`, `w_gate_up` and `w_down`; the model holds `layers` and `lm_head`.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .matmul import PACK_ROWS, BlockWeight, RowGroups, pack, panels, tiled
from .ops import rope_cos_sin


def set_weight(module: nn.Module, name: str, w: Tensor | BlockWeight | RowGroups) -> None:
    """Put w where the module's fp32 parameter `name` was (a module may not overwrite a parameter in place): how a
    family's loader hands it a file's blocks."""
    delattr(module, name)
    setattr(module, name, w)


class DecoderLM(nn.Module):
    """The family-independent half of a decoder-only model (`Llama`, `Gemma3` subclass it)."""

    layers: nn.ModuleList
    inv_freq: Tensor  # the rotation speeds (`rope_frequencies`); Gemma 3's sliding layers: inv_freq_local

    def __init__(self):
        super().__init__()
        self._rope_tables: dict[bool, tuple[Tensor, Tensor]] = {}  # local or not -> cos, sin (P, D), grown on demand

    def rope(self, positions: Tensor, local: bool = False) -> tuple[Tensor, Tensor]:
        """cos/sin (B, T, 1, D) for integer positions, looked up in a table computed once (`local`: a sliding
        layer's rotation speeds, Gemma 3's).

        The table holds exactly what `rope_cos_sin` computes, so cached and uncached paths agree
        bit for bit; it grows (doubling) when a position beyond it is asked for.
        """
        lo, hi = (int(p) for p in torch.aminmax(positions))
        if lo < 0:  # not a table index: compute directly
            cos, sin = rope_cos_sin(self.inv_freq_local if local else self.inv_freq, positions)
            return cos.to(self.dtype), sin.to(self.dtype)
        cos, sin = self.rope_tables(hi, positions.device, local)
        return cos[positions][:, :, None], sin[positions][:, :, None]

    def rope_tables(self, max_position: int, device: torch.device | str = "cpu", local: bool = False,
                    ) -> tuple[Tensor, Tensor]:
        """The cos/sin tables (P, D) `rope` reads, covering positions 0..max_position at least: what the compiled
        step (`model.compiled`) looks its positions up in too."""
        table = self._rope_tables.get(local)
        if table is None or table[0].shape[0] <= max_position or table[0].dtype != self.dtype \
                or table[0].device != torch.device(device):
            size = max(256, 1 << max_position.bit_length())
            speeds = self.inv_freq_local if local else self.inv_freq
            cos, sin = rope_cos_sin(speeds, torch.arange(size, device=device)[None])
            table = self._rope_tables[local] = (cos[0, :, 0].to(self.dtype), sin[0, :, 0].to(self.dtype))  # (P, D)
        return table

    def matrices(self) -> list[Tensor | BlockWeight | RowGroups]:
        """Every matrix a product multiplies by: each layer's four, then the head."""
        return [w for blk in self.layers for w in (blk.wqkv, blk.wo, blk.w_gate_up, blk.w_down)] + [self.lm_head]

    def block_weights(self) -> list[BlockWeight]:
        """The matrices held as GGUF blocks, row groups' parts included (none for a model loaded from safetensors)."""
        return [m for m in self.modules() if isinstance(m, BlockWeight)]

    @property
    def activations(self) -> str:
        """What the block matrices multiply: "int8" where they take int8-quantized activations, "fp32" where
        they take x as it is (and for a model off blocks); "mixed" if they differ."""
        kinds = {w.activations for w in self.block_weights()} or {"fp32"}
        return kinds.pop() if len(kinds) == 1 else "mixed"

    @property
    def matrix_dtype(self) -> str:
        """What the products multiply: "gguf blocks" for a model on GGUF blocks, else the matrices' dtype."""
        if self.block_weights():
            return "gguf blocks"
        return str(self.layers[0].wqkv.dtype).removeprefix("torch.")

    def pack_weights(self, rows: int = PACK_ROWS) -> int:
        """Give every matrix a copy laid out for its product (`pack`: tiles on x86 CPUs, else oneDNN's blocks):
        faster products, for the memory of the weights once more. Returns the bytes added (0 without either)."""
        mats = {id(w): w for w in self.matrices() if isinstance(w, Tensor)}
        return sum(w.numel() * w.element_size() for w in mats.values() if pack(w, rows))

    def one_row_same_bits(self, compiled: bool | None) -> bool:
        """Whether a step of one row gives it the bits a step of many would, with no rows added: every product on
        the tiles (`matmul.tiled`, the kernels on: fp32 on x86 CPUs, bf16 on AVX512_BF16 ones), a bf16 matrix's
        panels elsewhere (`matmul.panels`: the widening kernel, one order for any row count) or on the block
        kernels (GGUF blocks or row groups of them: each output row from its own row of x, `quant.block_linear`,
        `kernels.int8`). Elsewhere a batch-invariant runner pads one row to more."""
        def alone(w: Tensor | BlockWeight | RowGroups) -> bool:
            return isinstance(w, BlockWeight | RowGroups) or tiled(w) is not None or panels(w) is not None
        return bool(compiled) and all(map(alone, self.matrices()))

    def cast_matrices(self, dtype: torch.dtype) -> DecoderLM:
        """Hold every matrix (and the token table) in `dtype` and the K/V rounded to it, the norms and the
        residual stream staying fp32: torch.autocast's bf16, each product on bf16 inputs with fp32 sums,
        norms, RoPE and softmax in fp32 (a family's forward widens a bf16 product's output, exactly, where fp32
        reads it). Half the bytes per decode step and per cached token. In place."""
        if self.block_weights():
            raise ValueError("a model on GGUF blocks multiplies its blocks in fp32; cast_matrices needs dense weights")
        with torch.no_grad():
            for w in {id(w): w for w in [*self.matrices(), self.embed]}.values():
                assert isinstance(w, nn.Parameter)
                w.data = w.data.to(dtype)  # keeps the [in, out] layout (strides preserved)
                w.__dict__.pop("_nanoserve_packed", None)  # a copy of the old numbers: `pack` anew
                w.__dict__.pop("_nanoserve_tiles", None)
                w.__dict__.pop("_nanoserve_panels", None)
        return self.round_kv(dtype)

    def round_kv(self, dtype: torch.dtype) -> DecoderLM:
        """Hold the K/V cache in `dtype` (bf16; fp32 undoes it): q, k and v rounded to its numbers after RoPE, on
        every road, everything else as it was. Half the bytes per cached token, which every decode step reads
        once per layer: the larger part of a long context's step on the blocks. In place."""
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"a K/V cache holds float32 or bfloat16, not {dtype}")
        for blk in self.layers:
            blk.kv_dtype = None if dtype == self.dtype else dtype
        return self

    @property
    def kv_dtype(self) -> torch.dtype:
        """The dtype a cache holds this model's K/V in: its forward's, or the matrices' after `cast_matrices`."""
        return self.layers[0].kv_dtype or self.dtype

    def num_parameters(self) -> int:
        """Weights, whatever holds them (tied weights are counted once)."""
        return sum(p.numel() for p in self.parameters()) + sum(w.numel() for w in self.block_weights())

    def weight_bytes(self) -> int:
        """Bytes a decode step must stream: every parameter once (tied embeddings once, no copies).

        Exact for tied models (the head reads the whole table, the lookup one row of it); an untied
        model's input table is counted too, although a step reads only one row of it.
        """
        return (sum(p.numel() * p.element_size() for p in self.parameters())
                + sum(w.nbytes() for w in self.block_weights()))
