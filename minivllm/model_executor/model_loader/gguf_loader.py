"""GGUF tensors for the packed path (`quantization="gguf"`): block bytes, not dequantised values.

Every 2-D weight comes out as `<hf module>.qweight` (what the GGUF methods register): uint8
`[rows, row_bytes]` for block types, a float tensor `[rows, cols]` for F32/F16/BF16, with its
GGML type on `tensor.gguf_type`. Other tensors (norms) come out dequantised under their HF
name, as in the dequantising reader; so do MoE routers (an unquantized ReplicatedLinear). MoE
experts, stacked [E, rows, cols] in the file, come out one expert at a time as
`<moe>.experts.{e}.<proj>.qweight`, packed like the 2-D weights (GGUFMoEMethod keeps them so).
Rows of one matrix are independent in every GGUF type, so llama.cpp's per-head Q/K row order is
undone on the packed rows directly.
"""

import ctypes
import ctypes.util
import functools
import mmap
from typing import TYPE_CHECKING

import numpy as np
import torch

from minivllm.model_executor.model_loader.weight_iterators import (Weights, gguf_tensors,
                                                                   merge_mla_kv_b, split_experts)
from minivllm.transformers_utils.gguf_file import open_gguf

if TYPE_CHECKING:     # transformers costs ~1 s to import; GGUF runs skip it
    from transformers import PretrainedConfig


# MoE routers (and Qwen2-MoE's shared-expert gate): unquantized ReplicatedLinears.
_MOE_ROUTERS = (".ffn_gate_inp.weight", ".ffn_gate_inp_shexp.weight")


def gguf_quant_weights_iterator(path: str, hf_config: "PretrainedConfig") -> Weights:
    """`(name, tensor)` pairs of a .gguf file with its 2-D weights kept in their block format
    (DeepSeek's split k_b / v_b joined into one F32 kv_b_proj: MLA absorbs it dequantised)."""
    yield from merge_mla_kv_b(_packed_weights(path, hf_config), packed=True)


def _packed_weights(path: str, hf_config: "PretrainedConfig") -> Weights:
    import gguf

    for tensor, name, shape, unpermute in gguf_tensors(path, hf_config):
        qtype = int(tensor.tensor_type)
        if len(shape) == 3 and "{}" in name and name.endswith(".weight"):
            yield from _packed_experts(tensor, name, shape)
            _release(tensor.data)
            continue
        if len(shape) != 2 or not name.endswith(".weight") or tensor.name.endswith(_MOE_ROUTERS):
            data = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
            yield from split_experts(name, unpermute(
                torch.from_numpy(np.ascontiguousarray(data).reshape(shape)).float()))
            _release(tensor.data)
            continue
        # Block types: [rows, row_bytes] uint8, exactly the file's bytes; floats: [rows, cols].
        # A view of the mapped file (the method copies what this rank keeps).
        weight = torch.from_numpy(tensor.data.reshape(shape[0], -1))
        if tensor.tensor_type == gguf.GGMLQuantizationType.BF16:   # raw bytes: numpy has no bf16
            weight = weight.view(torch.bfloat16)
        weight = unpermute(weight)
        weight.gguf_type = qtype
        yield name[: -len(".weight")] + ".qweight", weight
        # The GGUF methods copied this rank's part as it arrived: the file's pages can go now,
        # so the peak holds the packed weights about once.
        _release(tensor.data)


def dequantize_for_plain_layers(weights: Weights, param_names: set[str]) -> Weights:
    """The packed stream for a model some of whose layers were built without the quant config
    (vLLM's Mixtral file embeds its tokens so): a `<module>.qweight` whose module holds a plain
    `weight` instead arrives dequantised, [rows, cols] fp32, as that `weight`."""
    import gguf

    for name, weight in weights:
        plain = name[: -len(".qweight")] + ".weight"
        if name.endswith(".qweight") and name not in param_names and plain in param_names:
            qtype = gguf.GGMLQuantizationType(weight.gguf_type)
            if weight.dtype == torch.bfloat16:
                yield plain, weight.float()
                continue
            data = gguf.quants.dequantize(weight.numpy(), qtype)
            yield plain, torch.from_numpy(np.ascontiguousarray(data)).float()
            continue
        yield name, weight


def _packed_experts(tensor, name: str, shape: tuple[int, ...]) -> Weights:
    """A stacked expert tensor [E, rows, cols] as E `experts.{e}.<proj>.qweight` views of the
    file's rows (uint8 block rows, or floats), each with its `gguf_type` (GGUFMoEMethod copies
    this rank's part)."""
    import gguf

    data = torch.from_numpy(tensor.data.reshape(shape[0], shape[1], -1))
    if tensor.tensor_type == gguf.GGMLQuantizationType.BF16:       # raw bytes: numpy has no bf16
        data = data.view(torch.bfloat16)
    for expert in range(shape[0]):
        weight = data[expert]
        weight.gguf_type = int(tensor.tensor_type)
        yield name.format(expert)[: -len(".weight")] + ".qweight", weight


_MADV_DONTNEED = 4


def release_file_pages(path: str) -> int:
    """Drop the mapped GGUF data from this process's memory once loading is done (the GGUF
    methods copied what each rank keeps); returns the bytes released.

    The mapping is private and never written, so a page touched again is just read back from the
    page cache.
    """
    tensors = open_gguf(path).tensors
    if not tensors:
        return 0
    return _release_pages(min(t.data.ctypes.data for t in tensors),
                          max(t.data.ctypes.data + t.data.nbytes for t in tensors))


def _release(array: np.ndarray) -> None:
    _release_pages(array.ctypes.data, array.ctypes.data + array.nbytes)


def _release_pages(lo: int, hi: int) -> int:
    """madvise(DONTNEED) the whole pages inside [lo, hi); the bytes released (0 if refused)."""
    a = -(-lo // mmap.PAGESIZE) * mmap.PAGESIZE
    b = hi // mmap.PAGESIZE * mmap.PAGESIZE
    madvise = _libc_madvise()
    if b <= a or madvise is None or madvise(a, b - a, _MADV_DONTNEED) != 0:
        return 0
    return b - a


@functools.cache
def _libc_madvise():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    madvise = getattr(libc, "madvise", None)
    if madvise is not None:
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return madvise
