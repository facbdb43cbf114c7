"""`minivllm bench make-gguf`: re-quantized variants (Q8_0, Q4_K, ...) of a GGUF model, for benchmarks.

Legacy types (F16, Q4_0 ... Q8_0) are written here with gguf-py: every tensor is dequantised to
fp32 and its 2-D weights re-quantized (1-D norms stay F32); all metadata (hparams, tokenizer, chat
template) is copied. K-quants need llama.cpp's quantizer (`llama_cpp.llama_model_quantize`), fed
an F16 intermediate written the same way. A variant of a quantized file carries that file's
rounding too: Q8_0 of the default Q4_1 model holds the Q4_1 values, nearly exactly.
"""

import argparse
import os
import re
import tempfile
from collections import Counter

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize, quantize

from minivllm.benchmarks.llama_cpp import import_llama_cpp
from minivllm.config.model import default_model_path

# --type -> (tensor type of the 2-D weights, general.file_type), written by gguf-py.
LEGACY_TYPES: dict[str, tuple[GGMLQuantizationType, LlamaFileType]] = {
    "F32": (GGMLQuantizationType.F32, LlamaFileType.ALL_F32),
    "F16": (GGMLQuantizationType.F16, LlamaFileType.MOSTLY_F16),
    "BF16": (GGMLQuantizationType.BF16, LlamaFileType.MOSTLY_BF16),
    "Q4_0": (GGMLQuantizationType.Q4_0, LlamaFileType.MOSTLY_Q4_0),
    "Q4_1": (GGMLQuantizationType.Q4_1, LlamaFileType.MOSTLY_Q4_1),
    "Q5_0": (GGMLQuantizationType.Q5_0, LlamaFileType.MOSTLY_Q5_0),
    "Q5_1": (GGMLQuantizationType.Q5_1, LlamaFileType.MOSTLY_Q5_1),
    "Q8_0": (GGMLQuantizationType.Q8_0, LlamaFileType.MOSTLY_Q8_0),
}
# --type -> llama.cpp's file type; the bare K names mean llama-quantize's defaults (_M).
K_QUANT_TYPES: dict[str, str] = {
    "Q2_K": "LLAMA_FTYPE_MOSTLY_Q2_K", "Q3_K_S": "LLAMA_FTYPE_MOSTLY_Q3_K_S",
    "Q3_K_M": "LLAMA_FTYPE_MOSTLY_Q3_K_M", "Q3_K_L": "LLAMA_FTYPE_MOSTLY_Q3_K_L",
    "Q4_K_S": "LLAMA_FTYPE_MOSTLY_Q4_K_S", "Q4_K_M": "LLAMA_FTYPE_MOSTLY_Q4_K_M",
    "Q5_K_S": "LLAMA_FTYPE_MOSTLY_Q5_K_S", "Q5_K_M": "LLAMA_FTYPE_MOSTLY_Q5_K_M",
    "Q6_K": "LLAMA_FTYPE_MOSTLY_Q6_K",
    "Q3_K": "LLAMA_FTYPE_MOSTLY_Q3_K_M", "Q4_K": "LLAMA_FTYPE_MOSTLY_Q4_K_M",
    "Q5_K": "LLAMA_FTYPE_MOSTLY_Q5_K_M",
}
VARIANT_TYPES = (*LEGACY_TYPES, *K_QUANT_TYPES)
DEFAULT_OUT_DIR = os.path.join("~", ".cache", "minivllm", "gguf")
# Keys the writer produces itself (header counts, the architecture it is constructed with).
_WRITER_KEYS = ("GGUF.", "general.architecture")
# A trailing quantization tag in a file name: `SmolLM2-135M-Instruct.Q4_1` -> `SmolLM2-135M-Instruct`.
_QUANT_SUFFIX = re.compile(r"[.-](F16|F32|BF16|Q\d(_[0-9A-Z]+)*)$", re.IGNORECASE)


def add_make_gguf_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--type", required=True, type=str.upper, choices=VARIANT_TYPES,
                        help="weight type of the variant (Q4_K = Q4_K_M, as llama-quantize)")
    parser.add_argument("--model", default=None,
                        help="source .gguf (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--out", default=None,
                        help=f"where to write it (default: {DEFAULT_OUT_DIR}/<model>.<TYPE>.gguf)")
    return parser


def run_make_gguf(args: argparse.Namespace) -> str:
    """Writes the variant `args` describe and prints what it holds; returns its path."""
    src = os.path.expanduser(args.model) if args.model else default_model_path()
    if not src.endswith(".gguf") or not os.path.isfile(src):
        raise ValueError(f"--model must be an existing .gguf file, got {src!r}")
    out = os.path.expanduser(args.out) if args.out else default_out_path(src, args.type)
    make_variant(src, out, args.type)
    types = Counter(t.tensor_type.name for t in GGUFReader(out).tensors)
    print(f"Wrote {out} ({os.path.getsize(out) / 2**20:.1f} MiB; tensors: "
          f"{', '.join(f'{n} {name}' for name, n in types.most_common())})")
    return out


def default_out_path(src: str, type_name: str) -> str:
    stem = _QUANT_SUFFIX.sub("", os.path.splitext(os.path.basename(src))[0])
    return os.path.join(os.path.expanduser(DEFAULT_OUT_DIR), f"{stem}.{type_name}.gguf")


def make_variant(src: str, out: str, type_name: str) -> str:
    """`src` re-quantized to `type_name` (one of VARIANT_TYPES), written to `out`."""
    if os.path.abspath(src) == os.path.abspath(out):
        raise ValueError(f"--out must differ from the source model {src!r}")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    if type_name in LEGACY_TYPES:
        return requantize_gguf(src, out, *LEGACY_TYPES[type_name])
    if type_name not in K_QUANT_TYPES:
        raise ValueError(f"Unknown GGUF type {type_name!r}; choose one of {', '.join(VARIANT_TYPES)}")
    with tempfile.TemporaryDirectory(dir=os.path.dirname(os.path.abspath(out))) as tmp:
        # NOTE: llama.cpp quantizes best from unquantized weights; F16 keeps the source's values
        # (Q4_1/Q8_0 dequantised values are exact in F16 up to its 11-bit mantissa).
        f16 = requantize_gguf(src, os.path.join(tmp, "f16.gguf"), *LEGACY_TYPES["F16"])
        return llama_cpp_quantize(f16, out, K_QUANT_TYPES[type_name])


def requantize_gguf(src: str, out: str, qtype: GGMLQuantizationType, file_type: LlamaFileType) -> str:
    """Copies `src`'s metadata to `out` and re-quantizes its 2-D tensors to `qtype` with gguf-py."""
    reader = GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = GGUFWriter(out, arch)
    writer.data_alignment = int(reader.alignment)    # general.alignment, copied below, must hold
    _copy_metadata(reader, writer)
    writer.add_uint32("general.file_type", int(file_type))
    for tensor in reader.tensors:
        # [ne1, ne0] float32: numpy's shape is ggml's reversed
        values = dequantize(tensor.data, tensor.tensor_type).reshape(tuple(reversed(tensor.shape.tolist())))
        target = _target_type(values, qtype)
        writer.add_tensor(tensor.name, quantize(values, target),
                          raw_dtype=target if target not in _NUMPY_TYPES else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def llama_cpp_quantize(src: str, out: str, ftype_name: str) -> str:
    """llama.cpp's own quantizer (`llama_model_quantize`), as the `llama-quantize` tool runs it."""
    llama_cpp = import_llama_cpp("`minivllm bench make-gguf` with a K-quant type")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, ftype_name)
    params.allow_requantize = True
    params.nthread = os.cpu_count() or 1
    rc = llama_cpp.llama_model_quantize(src.encode(), out.encode(), params)
    if rc != 0:
        raise ValueError(f"llama_model_quantize({src!r} -> {ftype_name}) failed with code {rc}")
    return out


# Types gguf-py's writer infers from the numpy dtype (quantize() returns plain float arrays).
_NUMPY_TYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16)


def _target_type(values: np.ndarray, qtype: GGMLQuantizationType) -> GGMLQuantizationType:
    """Norms and other 1-D tensors stay F32; a row that no block size divides falls back to F16."""
    if values.ndim < 2:
        return GGMLQuantizationType.F32
    block_size = GGML_QUANT_SIZES[qtype][0]
    return qtype if values.shape[-1] % block_size == 0 else GGMLQuantizationType.F16


def _copy_metadata(reader: GGUFReader, writer: GGUFWriter) -> None:
    """Every key-value field of `reader` (tokenizer, chat template, hparams) into `writer`."""
    for name, field in reader.fields.items():
        if name.startswith(_WRITER_KEYS) or name == "general.file_type":
            continue
        vtype = field.types[0]
        sub_type = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), vtype, sub_type=sub_type)
