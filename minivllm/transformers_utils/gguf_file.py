"""One read per process of a GGUF file: its metadata, its tensor table and zero-copy tensor views.

Why not `gguf.GGUFReader`: it builds a numpy view per metadata item, ~300k of them for a 49k-token
vocabulary, which took ~2.8 s per parse; config, tokenizer and weights each parsed the file. This
reader walks the documented v3 layout once with `struct` (header, key/value pairs, tensor infos,
aligned data section), keeps the file memory-mapped and hands out numpy views of it, so nothing is
read from disk until a tensor's bytes are touched. The constants (value types, quant block sizes)
come from the `gguf` package.
"""

import mmap
import os
import struct
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGMLQuantizationType, GGUFValueType

__all__ = ["GGUFFile", "GGUFTensorInfo", "open_gguf"]

_VERSIONS = (2, 3)     # v1 counted with 32-bit integers; v2 and v3 share the layout read here
# Fixed-size value types: struct format (little-endian) and numpy dtype for arrays of them.
_SCALARS: dict[GGUFValueType, tuple[str, type]] = {
    GGUFValueType.UINT8: ("<B", np.uint8), GGUFValueType.INT8: ("<b", np.int8),
    GGUFValueType.UINT16: ("<H", np.uint16), GGUFValueType.INT16: ("<h", np.int16),
    GGUFValueType.UINT32: ("<I", np.uint32), GGUFValueType.INT32: ("<i", np.int32),
    GGUFValueType.FLOAT32: ("<f", np.float32), GGUFValueType.BOOL: ("<?", np.bool_),
    GGUFValueType.UINT64: ("<Q", np.uint64), GGUFValueType.INT64: ("<q", np.int64),
    GGUFValueType.FLOAT64: ("<d", np.float64),
}
# Tensor types whose elements numpy can hold directly; every other type (the quantized blocks,
# and BF16, which numpy lacks) is exposed as its raw bytes, as gguf's ReaderTensor.data does.
_PLAIN_TENSORS = {
    GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor: its llama.cpp name, storage type, GGUF shape and a view of its bytes."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]   # GGUF order: fastest-moving dimension first (ggml's ne[0], ne[1], ...)
    # Zero-copy view of the mapped file. Plain types: their dtype, shape reversed(shape) (row-major,
    # e.g. [out, in]). Block types and BF16: uint8 [*reversed(shape)[:-1], row_bytes].
    data: np.ndarray = field(repr=False, compare=False)

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def n_bytes(self) -> int:
        return self.data.nbytes


@dataclass(frozen=True)
class GGUFFile:
    """A parsed GGUF file. `metadata` values: int / float / bool / str scalars, numeric arrays as
    numpy views, string arrays (the vocabulary, the merges) as lists of str."""

    path: str
    version: int
    metadata: dict[str, Any] = field(repr=False)
    tensors: list[GGUFTensorInfo] = field(repr=False)
    data_offset: int         # where the aligned tensor-data section starts in the file
    _by_name: dict[str, GGUFTensorInfo] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_name", {t.name: t for t in self.tensors})

    @property
    def architecture(self) -> str:
        return self.metadata["general.architecture"]

    def get_tensor(self, name: str) -> GGUFTensorInfo | None:
        """The tensor of that llama.cpp name (`output.weight`), or None when the file lacks it."""
        return self._by_name.get(name)


def open_gguf(path: str) -> GGUFFile:
    """The parsed file, read once per process: cached by absolute path and modification time."""
    path = os.path.abspath(path)
    stat = os.stat(path)
    return _open_cached(path, stat.st_mtime_ns, stat.st_size)


@lru_cache(maxsize=8)
def _open_cached(path: str, mtime_ns: int, size: int) -> GGUFFile:
    del mtime_ns, size      # only part of the cache key: a rewritten file is parsed again
    with open(path, "rb") as f:
        try:
            # Copy-on-write: the views are writable (torch.from_numpy takes them without a
            # warning) while the file itself can never change through them.
            # NOTE: a write still reaches every later reader in this process (one cached
            # mapping), so readers treat the views as read-only.
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        except ValueError as err:        # an empty file cannot be mapped
            raise ValueError(f"{path} is not a GGUF file ({err})") from err
    return _Parser(buf, path).parse()


class _Parser:
    """Walks the file front to back; `pos` is the read offset."""

    def __init__(self, buf: mmap.mmap, path: str) -> None:
        self.buf, self.path, self.pos = buf, path, 0

    def parse(self) -> GGUFFile:
        version, num_tensors, num_kvs = self._header()
        metadata: dict[str, Any] = {}
        for _ in range(num_kvs):
            key = self._string()
            if key in metadata:
                raise ValueError(f"{self.path}: metadata key {key!r} appears twice")
            metadata[key] = self._value(self._u32())
        if "general.architecture" not in metadata:
            raise ValueError(f"{self.path} has no general.architecture in its metadata")
        infos = [self._tensor_info() for _ in range(num_tensors)]
        alignment = int(metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT))
        data_offset = -(-self.pos // alignment) * alignment      # round up to the alignment
        tensors = [self._tensor(data_offset, *info) for info in infos]
        gguf_file = GGUFFile(self.path, version, metadata, tensors, data_offset)
        if len(gguf_file._by_name) != len(tensors):
            raise ValueError(f"{self.path} names a tensor twice")
        return gguf_file

    def _header(self) -> tuple[int, int, int]:
        if len(self.buf) < 24 or _U32.unpack_from(self.buf, 0)[0] != GGUF_MAGIC:
            raise ValueError(f"{self.path} is not a GGUF file (no GGUF magic)")
        version = _U32.unpack_from(self.buf, 4)[0]
        if version not in _VERSIONS:
            if version & 0xFFFF == 0:   # a small version number read with the wrong byte order
                raise NotImplementedError(f"{self.path} is a big-endian GGUF file; only "
                                          "little-endian files are supported")
            raise ValueError(f"{self.path}: GGUF version {version} is not supported "
                             f"(supported: {', '.join(map(str, _VERSIONS))})")
        num_tensors, num_kvs = struct.unpack_from("<QQ", self.buf, 8)
        self.pos = 24
        return version, num_tensors, num_kvs

    def _u32(self) -> int:
        (value,) = _U32.unpack_from(self.buf, self.pos)
        self.pos += 4
        return value

    def _u64(self) -> int:
        (value,) = _U64.unpack_from(self.buf, self.pos)
        self.pos += 8
        return value

    def _string(self) -> str:
        n = self._u64()
        start, self.pos = self.pos, self.pos + n
        return self.buf[start:self.pos].decode("utf-8")

    def _value(self, raw_type: int) -> Any:
        value_type = self._value_type(raw_type)
        if value_type == GGUFValueType.STRING:
            return self._string()
        if value_type == GGUFValueType.ARRAY:
            return self._array()
        fmt, _ = _SCALARS[value_type]
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def _array(self) -> Any:
        item_type = self._value_type(self._u32())
        count = self._u64()
        if item_type == GGUFValueType.STRING:
            return self._string_array(count)
        if item_type == GGUFValueType.ARRAY:
            return [self._array() for _ in range(count)]
        _, dtype = _SCALARS[item_type]
        # [count] zero-copy view (token types, scores, per-layer head counts)
        values = np.frombuffer(self.buf, dtype=np.dtype(dtype).newbyteorder("<"), count=count,
                               offset=self.pos)
        self.pos += values.nbytes
        return values

    def _string_array(self, count: int) -> list[str]:
        """Each item is [u64 length][utf-8 bytes]: the offsets depend on every earlier length,
        so this is one tight loop (~25 ms for 49k tokens), locals bound for speed."""
        buf, unpack, pos = self.buf, _U64.unpack_from, self.pos
        out = [""] * count
        for i in range(count):
            start = pos + 8
            pos = start + unpack(buf, pos)[0]
            out[i] = buf[start:pos].decode("utf-8")
        self.pos = pos
        return out

    def _value_type(self, raw: int) -> GGUFValueType:
        try:
            return GGUFValueType(raw)
        except ValueError:
            raise ValueError(f"{self.path}: unknown metadata value type {raw} at byte {self.pos}") from None

    def _tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._string()
        num_dims = self._u32()
        shape = struct.unpack_from(f"<{num_dims}Q", self.buf, self.pos)
        self.pos += 8 * num_dims
        raw_type = self._u32()
        return name, tuple(int(d) for d in shape), raw_type, self._u64()

    def _tensor(self, data_offset: int, name: str, shape: tuple[int, ...], raw_type: int,
                offset: int) -> GGUFTensorInfo:
        try:
            tensor_type = GGMLQuantizationType(raw_type)
        except ValueError:
            raise ValueError(f"{self.path}: tensor {name!r} has unknown ggml type {raw_type}") from None
        rows = tuple(reversed(shape))            # row-major order, slowest dimension first
        dtype = _PLAIN_TENSORS.get(tensor_type)
        if dtype is not None:
            view_shape, count = rows, int(np.prod(rows, dtype=np.int64))
        else:
            block_size, type_size = GGML_QUANT_SIZES[tensor_type]
            if shape[0] % block_size:
                raise ValueError(f"{self.path}: tensor {name!r} row of {shape[0]} elements is not "
                                 f"a whole number of {tensor_type.name} blocks ({block_size})")
            dtype = np.uint8
            view_shape = (*rows[:-1], shape[0] // block_size * type_size)
            count = int(np.prod(view_shape, dtype=np.int64))
        start = data_offset + offset
        if start + count * np.dtype(dtype).itemsize > len(self.buf):
            raise ValueError(f"{self.path}: tensor {name!r} runs past the end of the file (truncated?)")
        data = np.frombuffer(self.buf, dtype=dtype, count=count, offset=start).reshape(view_shape)
        return GGUFTensorInfo(name, tensor_type, shape, data)
