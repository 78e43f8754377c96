"""A GGUF file's header read in one pass over its memory map: the metadata and the tensor
table, each tensor's data a numpy view of the map (nothing copied).

`gguf.GGUFReader` builds a numpy view for every value of every field, which for a
tokenizer's 49,152 tokens and 48,900 merges took 4 of the 7 seconds a shard spent
opening the embedded model. Here a field's array is only walked to find where it ends,
and decoded when someone asks for it (the shard never does; `cadence convert` does).
Values read the same as `GGUFReader`'s `field.contents()` (checked in the tests).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import GGUFValueType as ValueType
from gguf.quants import quant_shape_to_byte_shape

MAGIC = b"GGUF"
VERSIONS = (2, 3)  # version 1 had 32-bit counts; no tool writes it any more
DEFAULT_ALIGNMENT = 32


# Fixed-size value types: their struct format (little-endian) and numpy dtype.
_SCALARS: dict[ValueType, tuple[str, str]] = {
    ValueType.UINT8: ("<B", "<u1"),
    ValueType.INT8: ("<b", "<i1"),
    ValueType.UINT16: ("<H", "<u2"),
    ValueType.INT16: ("<h", "<i2"),
    ValueType.UINT32: ("<I", "<u4"),
    ValueType.INT32: ("<i", "<i4"),
    ValueType.FLOAT32: ("<f", "<f4"),
    ValueType.BOOL: ("<?", "?"),
    ValueType.UINT64: ("<Q", "<u8"),
    ValueType.INT64: ("<q", "<i8"),
    ValueType.FLOAT64: ("<d", "<f8"),
}

# Tensor types whose data is a plain numpy array of values; every other type is bytes.
_VALUE_DTYPES = {
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of the file. `shape` lists dimensions as GGUF does (fastest first);
    `data` is typed values for float/integer types, else the raw blocks as uint8 rows."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray

    @property
    def hf_shape(self) -> tuple[int, ...]:
        """The shape numpy and torch use (slowest first)."""
        return tuple(reversed(self.shape))


@dataclass(frozen=True)
class _Array:
    """Where an array field's values lie, decoded on demand."""

    item: ValueType
    count: int
    offset: int
    nested: tuple[_Array, ...] = ()  # an array of arrays: each inner one


class GGUFFile:
    """A GGUF file (versions 2 and 3, little-endian) opened read-only."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._map = np.memmap(self.path, mode="r")
        if bytes(self._map[:4]) != MAGIC:
            raise ValueError(f"{self.path}: not a GGUF file (no GGUF magic)")
        version = _U32.unpack_from(self._map, 4)[0]
        if version not in VERSIONS:
            raise ValueError(
                f"{self.path}: GGUF version {version} (big-endian or unknown) is not supported"
            )
        tensor_count, field_count = struct.unpack_from("<QQ", self._map, 8)
        offset = 24
        self._fields: dict[str, Any] = {}
        for _ in range(field_count):
            key, offset = self._string(offset)
            kind = ValueType(_U32.unpack_from(self._map, offset)[0])
            self._fields[key], offset = self._value(kind, offset + 4)
        infos = []
        for _ in range(tensor_count):
            name, offset = self._string(offset)
            n_dims = _U32.unpack_from(self._map, offset)[0]
            shape = struct.unpack_from(f"<{n_dims}Q", self._map, offset + 4)
            offset += 4 + 8 * n_dims
            kind, start = struct.unpack_from("<IQ", self._map, offset)
            offset += 12
            infos.append((name, GGMLQuantizationType(kind), shape, start))
        alignment = self._fields.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"{self.path}: general.alignment {alignment!r} is not a power of two")
        self.data_offset = -(-offset // alignment) * alignment
        self.tensors = [self._tensor(*info) for info in infos]
        if len({t.name for t in self.tensors}) != len(self.tensors):
            raise ValueError(f"{self.path}: a tensor name appears twice")

    def field(self, key: str, default: Any = None) -> Any:
        """The metadata value under `key` as Python values (lists for arrays)."""
        if key not in self._fields:
            return default
        value = self._fields[key]
        return self._decode(value) if isinstance(value, _Array) else value

    def _string(self, offset: int) -> tuple[str, int]:
        length = _U64.unpack_from(self._map, offset)[0]
        start = offset + 8
        return bytes(self._map[start : start + length]).decode("utf-8"), start + length

    def _value(self, kind: ValueType, offset: int) -> tuple[Any, int]:
        """A field's value (an `_Array` for arrays) and the offset after it."""
        if kind == ValueType.STRING:
            return self._string(offset)
        if kind != ValueType.ARRAY:
            fmt = _SCALARS[kind][0]
            return struct.unpack_from(fmt, self._map, offset)[0], offset + struct.calcsize(fmt)
        item_raw, count = struct.unpack_from("<IQ", self._map, offset)
        item = ValueType(item_raw)
        start = offset + 12
        if item in _SCALARS:
            end = start + count * struct.calcsize(_SCALARS[item][0])
            return _Array(item, count, start), end
        if item == ValueType.STRING:
            end = start
            for _ in range(count):  # only the lengths are read here
                end += 8 + _U64.unpack_from(self._map, end)[0]
            return _Array(item, count, start), end
        nested, end = [], start
        for _ in range(count):
            inner, end = self._value(ValueType.ARRAY, end)
            nested.append(inner)
        return _Array(item, count, start, tuple(nested)), end

    def _decode(self, array: _Array) -> list[Any]:
        if array.item in _SCALARS:
            values = np.frombuffer(
                self._map, dtype=_SCALARS[array.item][1], count=array.count, offset=array.offset
            )
            return values.tolist()
        if array.item == ValueType.STRING:
            strings, offset = [], array.offset
            for _ in range(array.count):
                value, offset = self._string(offset)
                strings.append(value)
            return strings
        return [self._decode(inner) for inner in array.nested]

    def _tensor(
        self, name: str, kind: GGMLQuantizationType, shape: tuple[int, ...], start: int
    ) -> GGUFTensor:
        block, block_bytes = GGML_QUANT_SIZES[kind]
        elements = int(np.prod(shape, dtype=np.int64))
        offset = self.data_offset + start
        np_shape = tuple(reversed(shape))
        if (dtype := _VALUE_DTYPES.get(kind)) is not None:
            data = np.frombuffer(self._map, dtype=dtype, count=elements, offset=offset)
        else:
            count = elements * block_bytes // block
            data = np.frombuffer(self._map, dtype=np.uint8, count=count, offset=offset)
            np_shape = quant_shape_to_byte_shape(np_shape, kind)
        return GGUFTensor(name, kind, tuple(int(d) for d in shape), data.reshape(np_shape))
