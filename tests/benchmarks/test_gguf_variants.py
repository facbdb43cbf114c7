"""`minivllm bench make-gguf`: the re-quantizing GGUF writer on a tiny random file."""

import sys

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, LlamaFileType
from gguf.quants import dequantize

from minivllm.benchmarks.gguf_variants import default_out_path, make_variant
from minivllm.entrypoints.cli import build_parser, main
from tests.benchmarks._helpers import write_tiny_gguf


def _metadata(reader: GGUFReader) -> dict:
    return {name: field.contents() for name, field in reader.fields.items()
            if not name.startswith("GGUF.") and name != "general.file_type"}


def _values(reader: GGUFReader) -> dict[str, np.ndarray]:
    return {t.name: dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))
            for t in reader.tensors}


def test_q8_0_variant_keeps_metadata_and_values(tmp_path):
    path = write_tiny_gguf(str(tmp_path / "tiny.gguf"))
    src = GGUFReader(path)
    out = GGUFReader(make_variant(path, str(tmp_path / "out" / "tiny.Q8_0.gguf"), "Q8_0"))
    assert _metadata(out) == _metadata(src)
    assert "tokenizer.chat_template" in _metadata(out) and out.fields["llama.block_count"].contents() == 1
    assert out.fields["general.file_type"].contents() == LlamaFileType.MOSTLY_Q8_0
    types = {t.name: t.tensor_type for t in out.tensors}
    assert types == {"token_embd.weight": GGMLQuantizationType.Q8_0,
                     "blk.0.attn_q.weight": GGMLQuantizationType.Q8_0,
                     "blk.0.ffn_down.weight": GGMLQuantizationType.Q8_0,
                     "blk.0.attn_k.weight": GGMLQuantizationType.F16,    # 40 columns: no 32-block
                     "blk.0.attn_norm.weight": GGMLQuantizationType.F32}
    before, after = _values(src), _values(out)
    for name, x in before.items():
        assert after[name].shape == x.shape, name
        # Q8_0: per 32-block scale amax/127, rounding to the nearest step
        step = np.abs(x).max() / 127
        assert np.abs(after[name] - x).max() <= step / 2 + 1e-6, name
    # the source's Q8_0 tensor comes back exactly (same blocks, same scales)
    assert np.array_equal(after["blk.0.attn_q.weight"], before["blk.0.attn_q.weight"])


def test_cli_writes_a_legacy_variant(tmp_path, capsys):
    src = write_tiny_gguf(str(tmp_path / "tiny.Q8_0.gguf"))
    out = tmp_path / "tiny.Q4_0.gguf"
    assert main(["bench", "make-gguf", "--type", "q4_0", "--model", src, "--out", str(out)]) == 0
    assert f"Wrote {out}" in capsys.readouterr().out
    assert GGUFReader(str(out)).fields["general.file_type"].contents() == LlamaFileType.MOSTLY_Q4_0


def test_args_default_path_and_errors(tmp_path, capsys, monkeypatch):
    args = build_parser().parse_args(["bench", "make-gguf", "--type", "Q4_K"])
    assert (args.type, args.model, args.out) == ("Q4_K", None, None)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "make-gguf", "--type", "Q7_0"])
    assert default_out_path("/m/SmolLM2-135M-Instruct.Q4_1.gguf", "Q8_0").endswith(
        "/.cache/minivllm/gguf/SmolLM2-135M-Instruct.Q8_0.gguf")
    src = write_tiny_gguf(str(tmp_path / "tiny.gguf"))
    assert main(["bench", "make-gguf", "--type", "Q8_0", "--model", src, "--out", src]) == 2
    assert "--out must differ" in capsys.readouterr().err
    # K-quants need llama.cpp's quantizer: a clear error when llama_cpp does not import
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    assert main(["bench", "make-gguf", "--type", "Q4_K", "--model", src,
                 "--out", str(tmp_path / "k.gguf")]) == 2
    assert "pip install llama-cpp-python" in capsys.readouterr().err
