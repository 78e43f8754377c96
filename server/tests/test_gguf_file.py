"""cadence's GGUF header reader against gguf's own `GGUFReader`: every metadata value and
every tensor (name, type, shape, bytes) of the embedded model's file and of tiny files
written with each value type and the tensor types llama.cpp writes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from cadence.convert.gguf_file import GGUFFile
from cadence.model_source import embedded_gguf
from gguf import GGUFReader, GGUFValueType, GGUFWriter
from gguf_helpers import tiny_model, write_gguf


def assert_same_file(path: Path) -> None:
    ours, reference = GGUFFile(path), GGUFReader(path)
    keys = [k for k in reference.fields if not k.startswith("GGUF.")]
    for key in keys:
        assert ours.field(key) == reference.fields[key].contents(), key
    assert ours.field("no.such.key", "absent") == "absent"
    assert [t.name for t in ours.tensors] == [t.name for t in reference.tensors]
    for mine, theirs in zip(ours.tensors, reference.tensors, strict=True):
        assert mine.tensor_type == theirs.tensor_type, mine.name
        assert mine.shape == tuple(theirs.shape.tolist()), mine.name
        assert mine.data.dtype == theirs.data.dtype, mine.name
        assert mine.data.shape == theirs.data.shape, mine.name
        assert np.array_equal(mine.data.view(np.uint8), theirs.data.view(np.uint8)), mine.name
    assert ours.data_offset == reference.data_offset


def test_the_embedded_models_file_reads_as_gguf_reads_it() -> None:
    assert_same_file(embedded_gguf())


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_files_of_every_tensor_type_read_as_gguf_reads_them(arch: str, tmp_path: Path) -> None:
    path = tmp_path / f"{arch}.gguf"
    write_gguf(arch, tiny_model(arch), path)
    assert_same_file(path)


def test_every_metadata_value_type_reads_as_gguf_reads_it(tmp_path: Path) -> None:
    path = tmp_path / "values.gguf"
    writer = GGUFWriter(path, "llama")
    writer.add_uint8("v.u8", 250)
    writer.add_int8("v.i8", -7)
    writer.add_uint16("v.u16", 65000)
    writer.add_int16("v.i16", -30000)
    writer.add_uint32("v.u32", 4_000_000_000)
    writer.add_int32("v.i32", -2_000_000_000)
    writer.add_float32("v.f32", 1e-5)
    writer.add_uint64("v.u64", 2**63 + 5)
    writer.add_int64("v.i64", -(2**62))
    writer.add_float64("v.f64", 0.1)
    writer.add_bool("v.bool", True)
    writer.add_string("v.str", "héllo, wörld ✓")
    writer.add_string("v.empty", "")
    writer.add_array("v.floats", [0.5, -1.25, 3.0])
    writer.add_array("v.ints", [1, -2, 3])
    writer.add_array("v.strings", ["a", "", "ü", "long " * 50])
    writer.add_key_value("v.bools", [True, False], GGUFValueType.ARRAY, GGUFValueType.BOOL)
    writer.add_custom_alignment(64)
    writer.add_tensor("t", np.arange(6, dtype=np.float32).reshape(2, 3))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert_same_file(path)
    assert GGUFFile(path).data_offset % 64 == 0


def test_a_file_that_is_not_gguf_is_refused_by_name(tmp_path: Path) -> None:
    path = tmp_path / "weights.gguf"
    path.write_bytes(b"PK\x03\x04" + bytes(60))
    with pytest.raises(ValueError, match="not a GGUF file"):
        GGUFFile(path)
