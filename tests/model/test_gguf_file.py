"""`GGUFFile`, the loader's header reader: the same tensors and metadata as gguf's own `GGUFReader`, on the
shipped file and on a small file gguf's writer makes with the types the shipped file lacks; a file cut short
is an error, never a short tensor."""

import struct

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter

from nanoserve.config import nanoserve_home
from nanoserve.model.fetch import download_gguf
from nanoserve.model.gguf_file import GGUFFile


def assert_same_as_reader(path):
    mine, theirs = GGUFFile(path), GGUFReader(path)
    assert list(mine.fields) == [k for k in theirs.fields if not k.startswith("GGUF.")]  # (its own counts)
    for key, field in mine.fields.items():
        if key != "some.nested":  # (GGUFReader flattens an array of arrays)
            assert field.contents() == theirs.fields[key].contents(), key
    assert [t.name for t in mine.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(mine.tensors, theirs.tensors):
        assert a.tensor_type == b.tensor_type and a.shape == tuple(int(d) for d in b.shape), a.name
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert np.array_equal(a.data, b.data, equal_nan=True), a.name
    return mine


def test_the_shipped_file_reads_as_gguf_reads_it(model_dir):
    mine = assert_same_as_reader(download_gguf(nanoserve_home() / "downloads"))
    assert {t.tensor_type.name for t in mine.tensors} == {"Q4_1", "Q8_0", "F32"}
    assert len(mine.fields["tokenizer.ggml.tokens"].contents()) == 49152


@pytest.fixture
def small(tmp_path):
    """Strings, nested and numeric arrays, a non-default alignment, F16/I32/Q8_0 tensors, by gguf's writer."""
    path = tmp_path / "small.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_uint32("general.alignment", 64)
    w.add_float32("llama.rope.freq_base", 10000.0)
    w.add_bool("some.flag", True)
    w.add_array("tokenizer.ggml.tokens", ["a", "bé", "", "漢字"])
    w.add_array("some.ints", [3, -1, 7])
    w.add_array("some.nested", [[1, 2], [3]])
    rng = np.random.default_rng(0)
    w.add_tensor("f16", rng.standard_normal((3, 5)).astype(np.float16))
    w.add_tensor("i32", np.arange(7, dtype=np.int32))
    q8 = rng.integers(0, 256, (4, 34 * 2), dtype=np.uint8)  # 4 rows of 64 values: 2 blocks of 34 bytes each
    w.add_tensor("q8", q8, raw_dtype=GGMLQuantizationType.Q8_0)  # (its shape in bytes)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_every_kind_of_field_and_tensor_reads_as_gguf_reads_it(small):
    mine = assert_same_as_reader(small)
    assert mine.fields["some.nested"].contents() == [[1, 2], [3]]
    assert [t.data.shape for t in mine.tensors] == [(3, 5), (7,), (4, 68)]


def test_a_file_cut_short_is_an_error_not_a_short_tensor(small, tmp_path):
    data, last = small.read_bytes(), GGUFReader(small).tensors[-1]
    for keep in (3, 40, last.data_offset + last.n_bytes - 1):  # in the magic, in the fields, in the last tensor
        cut = tmp_path / f"cut{keep}.gguf"
        cut.write_bytes(data[:keep])
        with pytest.raises((ValueError, struct.error)):
            GGUFFile(cut)
