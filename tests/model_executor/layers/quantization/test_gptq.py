"""GPTQ checkpoints: parsing, the input-dim packing and zero convention, act-order (desc_act)
with a random g_idx, whole models against transformers running the dequantised weights."""

import os

import pytest
import torch
from safetensors.torch import load_file

from minivllm import LLM
from minivllm.model_executor.layers.quantization import get_quantization_config
from minivllm.model_executor.layers.quantization.gptq import (GPTQConfig, GPTQLinearMethod,
                                                              unpack_gptq_qweight,
                                                              unpack_gptq_qzeros)
from tests.model_executor.layers.quantization._int4_checkpoints import (check_against_hf,
                                                                        int4_checkpoint, int4_llama,
                                                                        model_of, quantize_linear)


def test_config_parsing_and_errors():
    assert get_quantization_config("gptq") is GPTQConfig
    base = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True,
            "sym": False}
    config = GPTQConfig.from_config(base)
    assert (config.group_size, config.desc_act, config.sym, config.checkpoint_format) == \
        (128, True, False, "gptq")
    assert GPTQConfig.get_config_filenames() == ["quantize_config.json"]
    with pytest.raises(ValueError, match="8-bit weights is not supported; supported bits: 4"):
        GPTQConfig.from_config({**base, "bits": 8})
    with pytest.raises(ValueError, match="group_size 16 is not supported.*-1, 32, 64, 128"):
        GPTQConfig.from_config({**base, "group_size": 16})
    with pytest.raises(ValueError, match="checkpoint_format 'marlin'.*gptq, gptq_v2"):
        GPTQConfig.from_config({**base, "checkpoint_format": "marlin"})
    with pytest.raises(NotImplementedError, match="quantized lm_head"):
        GPTQConfig.from_config({**base, "lm_head": True})
    with pytest.raises(ValueError, match="not a GPTQ checkpoint.*--quantization int4"):
        GPTQConfig.from_config({})


def test_unpack_reads_input_dim_packing_and_v1_zeros():
    weight = torch.randn(16, 64)
    tensors, dequant = quantize_linear(weight, "gptq", 32)
    assert tensors["qweight"].shape == (8, 16) and tensors["qzeros"].shape == (2, 2)
    codes = unpack_gptq_qweight(tensors["qweight"])          # [K, N]
    zeros = unpack_gptq_qzeros(tensors["qzeros"]) + 1        # v1: stored zero - 1
    scales = tensors["scales"].float()
    groups = torch.arange(64) // 32
    torch.testing.assert_close(((codes - zeros[groups]) * scales[groups]).t(), dequant)


@pytest.mark.parametrize(("group_size", "desc_act", "sym"), [
    (32, False, False), (64, True, False), (128, True, True), (-1, False, True)])
def test_gptq_model_matches_transformers_fp32(tiny_llama_factory, tmp_path, group_size: int,
                                              desc_act: bool, sym: bool):
    quant_dir, dequant_dir = int4_checkpoint(tiny_llama_factory, tmp_path, "gptq", group_size,
                                         desc_act=desc_act, sym=sym)
    llm = check_against_hf(quant_dir, dequant_dir, "float32", atol=1e-3)
    layer = model_of(llm).model.layers[1].mlp.down_proj
    assert isinstance(layer.quant_method, GPTQLinearMethod)
    assert not {"qzeros", "scales", "g_idx"} & set(layer._parameters)
    # act-order keeps the permutation that makes each group's input rows contiguous
    assert (layer.input_perm is not None) == (desc_act and group_size != -1)
    # dequantize_weight undoes it: the fused q/k/v rows of the dequantised checkpoint
    qkv = model_of(llm).model.layers[0].self_attn.qkv_proj
    ref = load_file(os.path.join(dequant_dir, "model.safetensors"))
    expected = torch.cat([ref[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"])
    torch.testing.assert_close(qkv.quant_method.dequantize_weight(qkv), expected,
                               atol=1e-6, rtol=0)


def test_gptq_v2_zeros_and_bf16(tiny_llama_factory, tmp_path):
    quant_dir, dequant_dir = int4_checkpoint(tiny_llama_factory, tmp_path, "gptq", 64, desc_act=True,
                                         checkpoint_format="gptq_v2")
    check_against_hf(quant_dir, dequant_dir, "bfloat16", atol=0.1)


def test_unquantized_checkpoint_is_refused_with_the_online_choice(tiny_llama_factory):
    with pytest.raises(ValueError, match="not a GPTQ checkpoint.*--quantization int4"):
        LLM(model=int4_llama(tiny_llama_factory), dtype="bfloat16", quantization="gptq")


@pytest.mark.parametrize("group_size", [32, pytest.param(-1, marks=pytest.mark.slow)])
def test_gptq_tensor_parallel_2_matches_transformers(tiny_llama_factory, tmp_path,
                                                     group_size: int):
    # row-parallel ranks load qweight rows (packed along the input: in / 8 / T each) and their
    # groups; per-channel scales load whole on every rank
    quant_dir, dequant_dir = int4_checkpoint(tiny_llama_factory, tmp_path, "gptq", group_size)
    check_against_hf(quant_dir, dequant_dir, "float32", atol=1e-3, tensor_parallel_size=2)


def test_act_order_cannot_split_input_rows(tiny_llama_factory, tmp_path):
    quant_dir, _ = int4_checkpoint(tiny_llama_factory, tmp_path, "gptq", 64, desc_act=True)
    with pytest.raises(Exception, match="act-order.*cannot be split by input rows"):
        LLM(model=quant_dir, dtype="float32", tensor_parallel_size=2)
