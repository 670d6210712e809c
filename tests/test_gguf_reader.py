"""plait.runtime.gguf_reader.FastGGUFReader reads a GGUF file into exactly the structure
gguf's own reader builds (every field's offset, parts with their dtypes and values, data
indices and types; every tensor): on the default model's file, and on files written
here with every metadata value type (arrays of each scalar type and of strings, empty
and nested arrays, non-ASCII strings) in both byte orders (a big-endian file takes the
base class's code). transformers' GGUF loading runs with it in the reference checks
(conftest.hf_from_gguf), so this is what keeps those references transformers' own."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from conftest import smollm2_gguf_path

from plait.runtime.gguf_reader import FastGGUFReader, fast_gguf


def assert_same(path: str) -> None:
    fast, ref = FastGGUFReader(path), gguf.GGUFReader(path)
    assert list(fast.fields) == list(ref.fields)
    for name, a in fast.fields.items():
        b = ref.fields[name]
        assert (a.offset, a.name, a.data, a.types) == (b.offset, b.name, b.data, b.types), name
        assert len(a.parts) == len(b.parts), name
        for x, y in zip(a.parts, b.parts):
            assert x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y), name
        assert a.contents() == b.contents(), name
    assert [(t.name, t.tensor_type, list(t.shape), t.data_offset, t.n_bytes, t.field.offset) for t in fast.tensors] == \
        [(t.name, t.tensor_type, list(t.shape), t.data_offset, t.n_bytes, t.field.offset) for t in ref.tensors]
    for a, b in zip(fast.tensors, ref.tensors):
        assert a.data.dtype == b.data.dtype and np.array_equal(a.data, b.data), a.name
    assert (fast.data_offset, fast.alignment, fast.endianess) == (ref.data_offset, ref.alignment, ref.endianess)


def test_the_default_models_file_reads_the_same():
    assert_same(smollm2_gguf_path())


@pytest.mark.parametrize("endian", [gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG])
def test_every_value_type_reads_the_same(tmp_path, endian):
    path = str(tmp_path / "t.gguf")
    w = gguf.GGUFWriter(path, "llama", endianess=endian)
    w.add_uint8("u8", 7)
    w.add_int8("i8", -7)
    w.add_uint16("u16", 65535)
    w.add_int16("i16", -300)
    w.add_uint32("u32", 2**32 - 1)
    w.add_int32("i32", -(2**31))
    w.add_uint64("u64", 2**64 - 1)
    w.add_int64("i64", -(2**63))
    w.add_float32("f32", 1.5)
    w.add_float64("f64", -2.25)
    w.add_bool("b", True)
    w.add_string("s", "héllo ✓")
    w.add_string("empty_s", "")
    w.add_array("strings", ["a", "", "日本語", "x" * 300] * 50)
    w.add_array("ints", list(range(-100, 100)))
    w.add_array("floats", [0.5 * i for i in range(77)])
    w.add_array("bools", [True, False, True])
    w.add_array("empty", [])
    w.add_array("nested", [[1, 2, 3], [4, 5]])
    w.add_tensor("weight", np.arange(12, dtype=np.float32).reshape(3, 4))
    w.add_tensor("ids", np.arange(5, dtype=np.int32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert_same(path)
    r = FastGGUFReader(path)
    assert r.fields["strings"].contents()[:4] == ["a", "", "日本語", "x" * 300]
    assert r.fields["floats"].contents(3) == 1.5 and r.fields["ints"].contents(0) == -100
    assert r.fields["s"].contents() == "héllo ✓" and r.fields["u64"].contents() == 2**64 - 1
    # a file cut inside its vocabulary: an error, not a short read
    cut = tmp_path / "cut.gguf"
    data = open(path, "rb").read()
    cut.write_bytes(data[:r.fields["strings"].offset + 500])
    with pytest.raises((ValueError, IndexError)):
        FastGGUFReader(str(cut))


def test_fast_gguf_lends_the_class_for_the_block_only():
    original = gguf.GGUFReader
    with fast_gguf():
        assert gguf.GGUFReader is FastGGUFReader
    assert gguf.GGUFReader is original
    with pytest.raises(RuntimeError), fast_gguf():
        raise RuntimeError
    assert gguf.GGUFReader is original
