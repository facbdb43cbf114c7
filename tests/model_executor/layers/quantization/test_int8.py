"""Online int8 (weight-only, per channel) on a tiny Llama: int8 weights in memory, and the model
matches transformers running the dequantised weights."""

import pytest
import torch

from minivllm import LLM
from minivllm.model_executor.layers.quantization.int8 import Int8Config, Int8LinearMethod
from tests.model_executor.layers.quantization import _checkpoints as ck

# Weight-only: only the activation dtype's roundings separate the runs (bf16: as in the bf16
# entrypoint test; fp32: summation order).
ATOL = {"bfloat16": 0.05, "float32": 1e-3}


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_online_int8_matches_transformers(tiny_llama_factory, tmp_path, dtype):
    src = tiny_llama_factory()
    llm = LLM(model=src, quantization="int8", dtype=dtype, enforce_eager=True, block_size=4)
    model = llm.executor.worker.model_runner.model
    gate_up = model.model.layers[0].mlp.gate_up_proj
    assert isinstance(gate_up.quant_method, Int8LinearMethod)
    assert gate_up.weight.dtype == torch.int8 and gate_up.weight_scale.shape == (256,)
    # scales are bf16 values, so the bf16 kernel applies them exactly
    assert torch.equal(gate_up.weight_scale.to(torch.bfloat16).float(), gate_up.weight_scale)
    assert model.lm_head.weight.dtype == getattr(torch, dtype)
    results = ck.run_greedy(llm, ck.prompts())
    ck.write_reference_from_model(model, src, str(tmp_path / "int8"))
    ck.check_against_transformers(str(tmp_path / "int8_ref"), ck.prompts(), results, ATOL[dtype])


def test_int8_rejects_a_quantized_checkpoint():
    with pytest.raises(ValueError, match="compressed-tensors"):
        Int8Config.from_config({"quant_method": "gptq", "bits": 4})
    assert Int8Config.from_config({}).get_name() == "int8"
