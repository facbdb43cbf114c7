"""AWQ (GEMM format) checkpoints: parsing, the nibble order, whole models against transformers
running the dequantised weights, modules_to_not_convert."""

import json
import os

import pytest
import torch

from minivllm import LLM
from minivllm.model_executor.layers.quantization import (UnquantizedLinearMethod,
                                                         get_quantization_config)
from minivllm.model_executor.layers.quantization.awq import (AWQConfig, AWQLinearMethod,
                                                             unpack_awq)
from tests.model_executor.layers.quantization._int4_checkpoints import (AWQ_ORDER, check_against_hf,
                                                                        int4_checkpoint, int4_llama,
                                                                        model_of, pack_nibbles)


def test_config_reads_autoawq_and_transformers_keys():
    assert get_quantization_config("awq") is AWQConfig
    autoawq = AWQConfig.from_config({"quant_method": "awq", "w_bit": 4, "q_group_size": 64,
                                     "zero_point": True, "version": "GEMM"})
    hf = AWQConfig.from_config({"quant_method": "awq", "bits": 4, "group_size": 64,
                                "zero_point": True, "modules_to_not_convert": ["visual"]})
    assert (autoawq.group_size, autoawq.modules_to_not_convert) == (64, [])
    assert (hf.group_size, hf.modules_to_not_convert) == (64, ["visual"])
    assert AWQConfig.get_config_filenames() == ["quant_config.json", "quantize_config.json"]


def test_config_errors_name_the_supported_choices():
    base = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True}
    with pytest.raises(ValueError, match="3-bit weights is not supported; supported bits: 4"):
        AWQConfig.from_config({**base, "bits": 3})
    with pytest.raises(ValueError, match="group_size 256 is not supported.*32, 64, 128"):
        AWQConfig.from_config({**base, "group_size": 256})
    with pytest.raises(NotImplementedError, match="version 'gemv'.*'gemm'"):
        AWQConfig.from_config({**base, "version": "gemv"})
    with pytest.raises(ValueError, match="not an AWQ checkpoint.*--quantization int4"):
        AWQConfig.from_config({})


def test_unpack_follows_awq_pack_order():
    codes = torch.randint(0, 16, (5, 32), dtype=torch.int32)
    packed = pack_nibbles(codes, AWQ_ORDER)                 # [5, 4] int32
    assert torch.equal(unpack_awq(packed), codes)
    # nibble 1 of the first int32 holds column 2 (AWQ's interleaved order)
    assert int((packed[0, 0] >> 4) & 15) == int(codes[0, 2])


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_awq_model_matches_transformers_fp32(tiny_llama_factory, tmp_path, group_size: int):
    quant_dir, dequant_dir = int4_checkpoint(tiny_llama_factory, tmp_path, "awq", group_size)
    llm = check_against_hf(quant_dir, dequant_dir, "float32", atol=1e-3)
    layer = model_of(llm).model.layers[0].mlp.gate_up_proj
    assert isinstance(layer.quant_method, AWQLinearMethod)
    # repacked: uint8 codes [N, K/2] and [K/g', N, 2] scales/offsets; no checkpoint tensor left
    assert layer.qweight.dtype == torch.uint8 and layer.qweight.shape == (512, 64)
    assert not {"weight", "qzeros", "scales"} & set(layer._parameters)


def test_awq_model_bf16_and_quant_config_file(tiny_llama_factory, tmp_path):
    quant_dir, dequant_dir = int4_checkpoint(tiny_llama_factory, tmp_path, "awq", 64)
    # the quantization_config in quant_config.json instead (older AutoAWQ): named explicitly
    with open(os.path.join(quant_dir, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(quant_dir, "quant_config.json"), "w") as f:
        json.dump(config.pop("quantization_config"), f)
    with open(os.path.join(quant_dir, "config.json"), "w") as f:
        json.dump(config, f)
    check_against_hf(quant_dir, dequant_dir, "bfloat16", atol=0.1, quantization="awq")


def test_modules_to_not_convert_leaves_those_layers_unquantized(tiny_llama_factory, tmp_path):
    quant_dir, dequant_dir = int4_checkpoint(tiny_llama_factory, tmp_path, "awq", 128,
                                         skip=("layers.1.mlp", "layers.0.self_attn.o_proj"))
    llm = check_against_hf(quant_dir, dequant_dir, "float32", atol=1e-3)
    layers = model_of(llm).model.layers
    for layer in (layers[1].mlp.gate_up_proj, layers[1].mlp.down_proj, layers[0].self_attn.o_proj):
        assert isinstance(layer.quant_method, UnquantizedLinearMethod)
        assert layer.weight.dtype == torch.float32
    assert isinstance(layers[0].mlp.down_proj.quant_method, AWQLinearMethod)


def test_partly_skipped_fused_layer_raises(tiny_llama_factory, tmp_path):
    quant_dir, _ = int4_checkpoint(tiny_llama_factory, tmp_path, "awq", 128,
                               skip=("layers.0.self_attn.q_proj",))
    with pytest.raises(ValueError, match="some but not all shards of model.layers.0.self_attn."
                                         "qkv_proj.*q_proj \\(skipped\\).*k_proj \\(quantized\\)"):
        LLM(model=quant_dir, dtype="float32")


def test_unquantized_checkpoint_is_refused_with_the_online_choice(tiny_llama_factory):
    with pytest.raises(ValueError, match="not an AWQ checkpoint.*--quantization int4"):
        LLM(model=int4_llama(tiny_llama_factory), dtype="bfloat16", quantization="awq")


def test_awq_tensor_parallel_2_matches_transformers(tiny_llama_factory, tmp_path):
    # rank r loads its output columns of qweight / qzeros (packed: 1/8 the index) and scales,
    # and for o_proj / down_proj its input rows (whole groups)
    quant_dir, dequant_dir = int4_checkpoint(tiny_llama_factory, tmp_path, "awq", 32)
    check_against_hf(quant_dir, dequant_dir, "float32", atol=1e-3, tensor_parallel_size=2)
