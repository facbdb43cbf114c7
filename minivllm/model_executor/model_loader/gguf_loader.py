"""GGUF tensors for the packed path (`quantization="gguf"`): block bytes, not dequantised values.

Every 2-D weight comes out as `<hf module>.qweight` (what the GGUF methods register): uint8
`[rows, row_bytes]` for block types, a float tensor `[rows, cols]` for F32/F16/BF16, with its
GGML type on `tensor.gguf_type`. Other tensors (norms) come out dequantised under their HF
name, as in the dequantising reader. Rows of one matrix are independent in every GGUF type, so
llama.cpp's per-head Q/K row order is undone on the packed rows directly.
"""

import numpy as np
import torch
from transformers import PretrainedConfig

from minivllm.model_executor.model_loader.weight_iterators import (GGUF_PERMUTED_ARCHS,
                                                                   GGUF_UNUSED, Weights,
                                                                   gguf_to_hf_name,
                                                                   unpermute_rows)
from minivllm.transformers_utils.gguf_file import open_gguf


def gguf_quant_weights_iterator(path: str, hf_config: PretrainedConfig) -> Weights:
    """`(name, tensor)` pairs of a .gguf file with its 2-D weights kept in their block format."""
    import gguf

    gguf_file = open_gguf(path)     # parsed once per process, shared with config and tokenizer
    arch = gguf_file.architecture
    text_config = hf_config.get_text_config()
    num_heads = text_config.num_attention_heads
    num_kv_heads = getattr(text_config, "num_key_value_heads", None) or num_heads
    for tensor in gguf_file.tensors:
        if tensor.name in GGUF_UNUSED:
            continue
        name = gguf_to_hf_name(tensor.name)
        shape = tuple(int(d) for d in reversed(tensor.shape))      # HF order [out, in]
        qtype = int(tensor.tensor_type)
        if len(shape) != 2 or not name.endswith(".weight"):
            data = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
            yield name, torch.from_numpy(np.ascontiguousarray(data).reshape(shape)).float()
            continue
        # Block types: [rows, row_bytes] uint8, exactly the file's bytes; floats: [rows, cols].
        weight = torch.from_numpy(np.array(tensor.data).reshape(shape[0], -1))
        if tensor.tensor_type == gguf.GGMLQuantizationType.BF16:   # raw bytes: numpy has no bf16
            weight = weight.view(torch.bfloat16)
        if arch in GGUF_PERMUTED_ARCHS and ".q_proj." in name:
            weight = unpermute_rows(weight, num_heads)
        elif arch in GGUF_PERMUTED_ARCHS and ".k_proj." in name:
            weight = unpermute_rows(weight, num_kv_heads)
        weight.gguf_type = qtype
        yield name[: -len(".weight")] + ".qweight", weight
