"""A GGUF file's tensor table and metadata, read without walking its vocabulary (Day 25).

gguf's `GGUFReader` builds a numpy view for every element of every metadata array, and SmolLM2's file
carries its tokenizer as arrays of some 49k strings each: that walk was most of loading the blocks. Loading
needs the architecture's numbers and the tensor table only, so `GGUFFile` reads the header with `struct`,
steps over an array by its lengths (reading it only if asked), and maps each tensor's bytes as GGUFReader
does: the same names, types, shapes and dtypes (a test compares the two). The type tables are gguf's own.
The one-time conversion (`fetch`) still uses GGUFReader, which it needs whole for the tokenizer.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGMLQuantizationType
from gguf.constants import GGUFValueType as V

SCALARS = {V.UINT8: "<B", V.INT8: "<b", V.UINT16: "<H", V.INT16: "<h", V.UINT32: "<I", V.INT32: "<i",
           V.FLOAT32: "<f", V.BOOL: "<?", V.UINT64: "<Q", V.INT64: "<q", V.FLOAT64: "<d"}
ITEMS = {GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
         GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8, GGMLQuantizationType.I16: np.int16,
         GGMLQuantizationType.I32: np.int32, GGMLQuantizationType.I64: np.int64}
"""Tensor types mapped as numbers; any other (the block formats) is mapped as (rows, bytes per row) uint8."""


class GGUFTensor(NamedTuple):
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF's order, fastest-varying first (numpy's reversed), as GGUFReader gives it
    data: np.ndarray  # read-only, in the file's map


class Field(NamedTuple):
    """A metadata value: a scalar or a string as read, an array as where it lies (`contents` reads it)."""

    file: GGUFFile
    kind: V
    offset: int

    def contents(self) -> Any:
        return self.file.value(self.kind, self.offset)[0]


class GGUFFile:
    """`fields` (key -> Field) and `tensors` (GGUFTensor, in the file's order) of a GGUF file, v2 or v3."""

    def __init__(self, path: str | Path):
        self.data = np.memmap(path, mode="r")
        if self._unpack("<I", 0) != GGUF_MAGIC:
            raise ValueError("GGUF magic invalid")
        version = self._unpack("<I", 4)
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version}: versions 2 and 3 are read")
        n_tensors, n_fields = struct.unpack_from("<QQ", self.data, 8)
        offs, self.fields = 24, {}
        for _ in range(n_fields):
            key, offs = self.value(V.STRING, offs)
            kind = V(self._unpack("<I", offs))
            self.fields[key] = Field(self, kind, offs + 4)
            offs = self.value(kind, offs + 4, keep=False)[1]
        infos = []
        for _ in range(n_tensors):
            name, offs = self.value(V.STRING, offs)
            n_dims = self._unpack("<I", offs)
            dims = struct.unpack_from(f"<{n_dims}Q", self.data, offs + 4)
            kind, start = struct.unpack_from("<IQ", self.data, offs + 4 + 8 * n_dims)
            infos.append((name, dims, GGMLQuantizationType(kind), start))
            offs += 4 + 8 * n_dims + 12
        align = int(self.fields["general.alignment"].contents()) if "general.alignment" in self.fields else \
            GGUF_DEFAULT_ALIGNMENT
        base = -(-offs // align) * align
        self.tensors = [self._tensor(name, dims, kind, base + start) for name, dims, kind, start in infos]
        if len({t.name for t in self.tensors}) != len(self.tensors):
            raise ValueError("a tensor name appears twice")

    def _unpack(self, fmt: str, offs: int) -> Any:
        return struct.unpack_from(fmt, self.data, offs)[0]

    def value(self, kind: V, offs: int, keep: bool = True) -> tuple[Any, int]:
        """The value of type `kind` at `offs` (None unless `keep`), and the offset after it."""
        if kind == V.STRING:
            n = self._unpack("<Q", offs)
            if offs + 8 + n > len(self.data):
                raise ValueError(f"a string at byte {offs} runs past the end of the file")
            return (bytes(self.data[offs + 8:offs + 8 + n]).decode() if keep else None), offs + 8 + n
        if kind == V.ARRAY:
            item, n = struct.unpack_from("<IQ", self.data, offs)
            item, offs = V(item), offs + 12
            if item in SCALARS:  # fixed size: stepped over at once
                size = struct.calcsize(SCALARS[item])
                out = list(struct.unpack_from(f"<{n}{SCALARS[item][1]}", self.data, offs)) if keep else None
                return out, offs + n * size
            items = []
            for _ in range(n):
                v, offs = self.value(item, offs, keep)
                items.append(v)
            return (items if keep else None), offs
        return self._unpack(SCALARS[kind], offs), offs + struct.calcsize(SCALARS[kind])

    def _tensor(self, name: str, dims: tuple[int, ...], kind: GGMLQuantizationType, offs: int) -> GGUFTensor:
        block, size = GGML_QUANT_SIZES[kind]
        shape = tuple(reversed(dims))
        if kind in ITEMS:
            dtype, count = np.dtype(ITEMS[kind]), int(np.prod(dims))
        else:
            dtype, count = np.dtype(np.uint8), int(np.prod(dims)) // block * size
            shape = (*shape[:-1], shape[-1] // block * size)
        if offs + count * dtype.itemsize > len(self.data):
            raise ValueError(f"tensor {name!r}'s data runs past the end of the file")
        return GGUFTensor(name, kind, dims, self.data[offs:offs + count * dtype.itemsize].view(dtype).reshape(shape))


def gguf_field(reader, key: str, default: Any = None) -> Any:
    """A metadata value of a `gguf.GGUFReader` (or a `GGUFFile`), or `default` where the file has none."""
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def hf_tensors(reader, layer_names: Mapping[str, str]) -> Iterator[tuple[str, str | None, str | None, np.ndarray]]:
    """Every tensor of a `gguf.GGUFReader`, dequantized to fp32 in its shape, as (GGUF name, the layer part of a
    block tensor ("attn_q") or None, the Hugging Face name or None where the naming knows none, array). Block
    tensors are named by `layer_names` (a family's GGUF part -> HF part); a family's conversion fixes up the rest
    (Llama's q/k permutation, Gemma's 1 + w norms)."""
    from gguf.quants import dequantize
    from tqdm.auto import tqdm

    top = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
    for t in tqdm(reader.tensors, desc="dequantize", unit="tensor"):
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        w = w.reshape([int(x) for x in reversed(t.shape)]) if w.ndim != len(t.shape) else w
        parts = t.name.split(".")
        if parts[0] == "blk" and len(parts) == 4 and parts[2] in layer_names:
            yield t.name, parts[2], f"model.layers.{parts[1]}.{layer_names[parts[2]]}.weight", w
        else:
            yield t.name, None, top.get(t.name), w
