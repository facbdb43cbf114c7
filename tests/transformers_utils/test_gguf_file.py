"""open_gguf: the same metadata, tensor table and bytes as gguf.GGUFReader, zero-copy, read once."""

import mmap
import os

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType

from minivllm.transformers_utils.gguf_file import GGUFFile, open_gguf


def _reference_metadata(reader: gguf.GGUFReader) -> dict:
    """GGUFReader's fields decoded to Python values (lists for arrays, str for strings)."""
    out = {}
    for key, f in reader.fields.items():
        if key.startswith("GGUF."):
            continue                                      # the header, which the reader lists too
        values = [f.parts[i] for i in f.data]
        if f.types[-1] == gguf.GGUFValueType.STRING:
            values = [bytes(v).decode("utf-8") for v in values]
        else:
            values = [v.tolist()[0] for v in values]
        out[key] = values if f.types[0] == gguf.GGUFValueType.ARRAY else values[0]
    return out


def _as_python(value):
    return value.tolist() if isinstance(value, np.ndarray) else value


def _assert_same_as_reader(ours: GGUFFile, path: str) -> None:
    reader = gguf.GGUFReader(path)
    assert {k: _as_python(v) for k, v in ours.metadata.items()} == _reference_metadata(reader)
    assert [t.name for t in ours.tensors] == [t.name for t in reader.tensors]
    for mine, ref in zip(ours.tensors, reader.tensors):
        assert mine.tensor_type == ref.tensor_type, mine.name
        assert mine.shape == tuple(int(d) for d in ref.shape), mine.name
        assert mine.data.dtype == ref.data.dtype and mine.data.shape == ref.data.shape, mine.name
        assert np.array_equal(mine.data, ref.data), mine.name
        assert mine.n_elements == int(ref.n_elements) and mine.n_bytes == int(ref.n_bytes)


def _is_file_view(data: np.ndarray) -> bool:
    base = data
    while isinstance(base, (np.ndarray, memoryview)):
        base = base.base if isinstance(base, np.ndarray) else base.obj
    return isinstance(base, mmap.mmap)


@pytest.fixture
def many_types_gguf(tmp_path) -> str:
    """Every metadata value type and the tensor types the default model and its variants use."""
    rng = np.random.default_rng(0)
    path = str(tmp_path / "types.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_uint8("t.u8", 7)
    writer.add_int8("t.i8", -7)
    writer.add_uint16("t.u16", 65535)
    writer.add_int16("t.i16", -300)
    writer.add_uint32("t.u32", 1 << 31)
    writer.add_int32("t.i32", -(1 << 30))
    writer.add_float32("t.f32", 1e-5)
    writer.add_uint64("t.u64", 1 << 40)
    writer.add_int64("t.i64", -(1 << 40))
    writer.add_float64("t.f64", 0.1)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo ✓")
    writer.add_array("t.ints", [1, 2, 3])
    writer.add_array("t.floats", [0.5, 1.5])
    writer.add_array("t.strs", ["a", "", "ß", "Ġthe"])
    writer.add_tensor("f32", rng.standard_normal((3, 4)).astype(np.float32))
    writer.add_tensor("f16", rng.standard_normal((5,)).astype(np.float16))
    for qtype in (GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.BF16):
        packed = gguf.quants.quantize(rng.standard_normal((2, 64)).astype(np.float32), qtype)
        writer.add_tensor(qtype.name.lower(), packed, raw_shape=packed.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_every_value_and_tensor_type_matches_gguf_reader(many_types_gguf):
    ours = open_gguf(many_types_gguf)
    _assert_same_as_reader(ours, many_types_gguf)
    meta = ours.metadata
    assert meta["t.str"] == "héllo ✓" and meta["t.strs"] == ["a", "", "ß", "Ġthe"]
    assert meta["t.bool"] is True and type(meta["t.u64"]) is int and type(meta["t.f32"]) is float
    assert ours.architecture == "llama" and ours.version == 3
    by_name = {t.name: t for t in ours.tensors}
    assert by_name["f32"].shape == (4, 3) and by_name["f32"].data.shape == (3, 4)   # GGUF order
    assert by_name["q8_0"].tensor_type == GGMLQuantizationType.Q8_0
    assert by_name["q8_0"].data.dtype == np.uint8 and by_name["q8_0"].data.shape == (2, 2 * 34)
    assert by_name["bf16"].data.shape == (2, 128)          # raw bytes, as GGUFReader gives BF16
    assert ours.get_tensor("q4_1") is by_name["q4_1"] and ours.get_tensor("nope") is None


def test_default_model_matches_gguf_reader_and_views_the_file(default_model_path):
    ours = open_gguf(default_model_path)
    _assert_same_as_reader(ours, default_model_path)
    assert len(ours.metadata["tokenizer.ggml.tokens"]) == 49152
    for t in ours.tensors:
        assert _is_file_view(t.data) and not t.data.flags.owndata, t.name
        assert t.data.flags.writeable         # copy-on-write: torch.from_numpy takes it silently


def test_parsed_once_per_path_and_modification_time(many_types_gguf):
    first = open_gguf(many_types_gguf)
    assert open_gguf(os.path.relpath(many_types_gguf)) is first
    stat = os.stat(many_types_gguf)
    os.utime(many_types_gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    second = open_gguf(many_types_gguf)
    assert second is not first and second.metadata["t.u8"] == 7


def test_views_are_zero_copy_and_never_write_the_file(many_types_gguf):
    before = open(many_types_gguf, "rb").read()
    tensor = open_gguf(many_types_gguf).get_tensor("f32")
    tensor.data[0, 0] = 123.0                      # a private page: the process sees it ...
    assert open_gguf(many_types_gguf).get_tensor("f32").data[0, 0] == 123.0
    assert open(many_types_gguf, "rb").read() == before   # ... the file does not


@pytest.mark.parametrize("damage,match", [
    (lambda b: b"GGML" + b[4:], "not a GGUF file"),
    (lambda b: b[:4] + (99).to_bytes(4, "little") + b[8:], "version 99"),
    (lambda b: b[:4] + (3 << 24).to_bytes(4, "little") + b[8:], "big-endian"),
    (lambda b: b[:-8], "runs past the end"),
    (lambda b: b"", "not a GGUF file"),
])
def test_broken_files_raise(tmp_path, many_types_gguf, damage, match):
    path = tmp_path / "broken.gguf"
    path.write_bytes(damage(open(many_types_gguf, "rb").read()))
    with pytest.raises((ValueError, NotImplementedError), match=match):
        open_gguf(str(path))
