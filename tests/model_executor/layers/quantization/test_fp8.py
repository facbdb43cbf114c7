"""fp8 checkpoints (per-tensor, block-wise, static / dynamic activations) and online fp8 on a tiny
Llama: the layers get the right methods, and the model matches transformers running the
dequantised weights (with the same fp8 rounding of the linears' inputs)."""

import pytest
import torch
import torch.nn as nn

from minivllm import LLM
from minivllm.config import ModelConfig, VllmConfig
from minivllm.distributed import ensure_model_parallel_initialized
from minivllm.model_executor.layers.quantization import UnquantizedLinearMethod
from minivllm.model_executor.layers.quantization.fp8 import Fp8Config, Fp8LinearMethod
from minivllm.model_executor.model_loader import get_model
from minivllm.model_executor.model_loader.utils import initialize_model
from minivllm.model_executor.models import llama as llama_module
from minivllm.model_executor.models.prefix_check import check_prefixes
from tests.model_executor.layers.quantization import _checkpoints as ck

SKIPPED = "model.layers.1.mlp.down_proj"
FP8_CONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic", "ignored_layers": [SKIPPED]}
# bf16 activations vs the fp32 reference: a bf16 rounding now and then moves an activation across
# an e4m3 rounding edge (one e4m3 step is 6-12%), so W8A8 runs differ more than bf16 ones do
# (measured here: 0.15-0.25; the weight-only fp8 scheme of test_compressed_tensors.py: 0.03).
W8A8_ATOL = 0.35


def fake_fp8_per_tensor(x: torch.Tensor) -> torch.Tensor:
    scale = (x.abs().amax() / 448).clamp(min=1e-12)
    return (x / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale


@pytest.fixture(scope="module")
def fp8_path(tiny_llama_factory, tmp_path_factory):
    src = tiny_llama_factory()
    dst = str(tmp_path_factory.mktemp("fp8") / "ckpt")
    return ck.write_quantized(src, dst, ck.fp8_per_tensor, FP8_CONFIG, skip=(SKIPPED,))


def _model(path: str, **model_kwargs) -> nn.Module:
    ensure_model_parallel_initialized(1, 1)
    config = VllmConfig(model_config=ModelConfig(model=path, dtype="bfloat16", **model_kwargs))
    return get_model(vllm_config=config)


def test_fp8_checkpoint_layers(fp8_path):
    model = _model(fp8_path)
    skipped = model.model.layers[1].mlp.down_proj
    assert type(skipped.quant_method) is UnquantizedLinearMethod
    assert skipped.weight.dtype == torch.bfloat16
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv.quant_method, Fp8LinearMethod)
    assert qkv.weight.dtype == torch.float8_e4m3fn
    # q, k and v kept their own checkpoint scales, one per output channel now
    assert qkv.weight_scale.shape == (qkv.weight.shape[0],)
    assert len(set(qkv.weight_scale.tolist())) == 3
    assert model.model.layers[1].mlp.gate_up_proj.weight.dtype == torch.float8_e4m3fn
    assert model.lm_head.weight.dtype == torch.bfloat16


def test_fp8_checkpoint_matches_transformers(fp8_path):
    llm = LLM(model=fp8_path, dtype="bfloat16", enforce_eager=True, block_size=4)
    results = ck.run_greedy(llm, ck.prompts())
    ck.check_against_transformers(fp8_path + "_ref", ck.prompts(), results, W8A8_ATOL, prepare=lambda m:
                                  ck.fake_quant_inputs(m, fake_fp8_per_tensor, skip=(SKIPPED,)))


def _wrong_prefix_row_linear(monkeypatch) -> None:
    """Give layer 1's down_proj the prefix a buggy model file would: `...mlp.down`."""
    original = llama_module.RowParallelLinear

    class WrongPrefix(original):
        def __init__(self, *args, prefix: str = "", **kwargs):
            if prefix == SKIPPED:
                prefix = "model.layers.1.mlp.down"
            super().__init__(*args, prefix=prefix, **kwargs)

    monkeypatch.setattr(llama_module, "RowParallelLinear", WrongPrefix)


def test_wrong_prefix_quantizes_the_ignored_layer(fp8_path, monkeypatch):
    """The seed's failure mode: `ignored_layers` is matched by prefix, so a layer built with the
    wrong prefix silently becomes fp8. check_prefixes finds it; loading then fails loudly."""
    _wrong_prefix_row_linear(monkeypatch)
    ensure_model_parallel_initialized(1, 1)
    config = VllmConfig(model_config=ModelConfig(model=fp8_path, dtype="bfloat16"))
    model = initialize_model(config)
    layer = model.model.layers[1].mlp.down_proj
    assert isinstance(layer.quant_method, Fp8LinearMethod)
    assert layer.weight.dtype == torch.float8_e4m3fn
    found = check_prefixes(model)
    assert [(m.path, m.prefix) for m in found] == [(SKIPPED, "model.layers.1.mlp.down")]
    # NOTE: today AutoWeightsLoader's cast note fails first (torch cannot promote bf16 with fp8:
    # RuntimeError); with that fixed, the fp8 method's missing-scale check raises ValueError.
    with pytest.raises((ValueError, RuntimeError), match="no weight_scale|Promotion"):
        _model(fp8_path)


def test_partly_skipped_fused_layer_names_the_shards(fp8_path):
    config = Fp8Config.from_config({**FP8_CONFIG, "ignored_layers": [
        "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj"]})
    config.packed_modules_mapping = llama_module.LlamaForCausalLM.packed_modules_mapping
    ensure_model_parallel_initialized(1, 1)
    vllm_config = VllmConfig(model_config=ModelConfig(model=fp8_path, dtype="bfloat16"))
    vllm_config.quant_config = config
    with pytest.raises(ValueError, match=r"v_proj \(quantized\)") as err:
        initialize_model(vllm_config)
    assert "q_proj (skipped)" in str(err.value)


def test_fp8_with_float32_names_the_fix(fp8_path):
    with pytest.raises(ValueError, match="--dtype bfloat16"):
        LLM(model=fp8_path, dtype="float32", enforce_eager=True)


def test_config_errors():
    with pytest.raises(ValueError, match="supported: static, dynamic"):
        Fp8Config.from_config({"quant_method": "fp8", "activation_scheme": "per_token"})
    with pytest.raises(ValueError, match="needs an fp8 checkpoint"):
        Fp8Config.from_config({"activation_scheme": "static"})
    with pytest.raises(ValueError, match="only activation_scheme 'dynamic'"):
        Fp8Config.from_config({"quant_method": "fp8", "activation_scheme": "static",
                               "weight_block_size": [128, 128]})
    online = Fp8Config.from_config({})
    assert not online.is_checkpoint_fp8_serialized and online.activation_scheme == "dynamic"


def test_online_fp8_matches_transformers(tiny_llama_factory, tmp_path):
    src = tiny_llama_factory()
    llm = LLM(model=src, quantization="fp8", dtype="bfloat16", enforce_eager=True, block_size=4)
    model = llm.executor.worker.model_runner.model
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == torch.float8_e4m3fn and qkv.weight_scale.numel() == 1
    results = ck.run_greedy(llm, ck.prompts())
    ck.write_reference_from_model(model, src, str(tmp_path / "online"))
    ck.check_against_transformers(str(tmp_path / "online_ref"), ck.prompts(), results, W8A8_ATOL,
                                  prepare=lambda m: ck.fake_quant_inputs(m, fake_fp8_per_tensor))


def test_block_fp8_matches_transformers(tiny_llama_factory, tmp_path):
    src = tiny_llama_factory()
    config = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32]}
    path = ck.write_quantized(src, str(tmp_path / "block"), ck.fp8_block_quantizer(32), config)
    llm = LLM(model=path, dtype="bfloat16", enforce_eager=True, block_size=4)
    gate_up = llm.executor.worker.model_runner.model.model.layers[0].mlp.gate_up_proj
    assert gate_up.weight_scale_inv.shape == (2 * 128 // 32, 64 // 32)
    results = ck.run_greedy(llm, ck.prompts())
    ck.check_against_transformers(path + "_ref", ck.prompts(), results, W8A8_ATOL,
                                  prepare=lambda m: ck.fake_quant_inputs(m, ck.fake_fp8_groups(32)))


def test_static_activation_scales(tiny_llama_factory, tmp_path):
    """activation_scheme static: one `input_scale` per checkpoint linear (q/k/v share the max)."""
    src = tiny_llama_factory()

    def quantize(name: str, w: torch.Tensor):
        tensors, deq = ck.fp8_per_tensor(name, w)
        return {**tensors, "input_scale": torch.tensor(8.0 / 448)}, deq

    config = {"quant_method": "fp8", "activation_scheme": "static"}
    path = ck.write_quantized(src, str(tmp_path / "static"), quantize, config)
    llm = LLM(model=path, dtype="bfloat16", enforce_eager=True, block_size=4)
    o_proj = llm.executor.worker.model_runner.model.model.layers[0].self_attn.o_proj
    assert o_proj.input_scale.item() == pytest.approx(8.0 / 448)
    results = ck.run_greedy(llm, ck.prompts())

    def fake_static(x: torch.Tensor) -> torch.Tensor:
        scale = 8.0 / 448
        return (x / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale

    ck.check_against_transformers(path + "_ref", ck.prompts(), results, W8A8_ATOL,
                                  prepare=lambda m: ck.fake_quant_inputs(m, fake_static))


@pytest.mark.parametrize("strategy", ["tensor", "channel"])
def test_online_fp8_layer_scales(strategy):
    """Online fp8 of one merged layer in fp16: one scale for the whole weight, or per channel."""
    from minivllm.model_executor.layers.linear import MergedColumnParallelLinear
    from tests.model_executor.layers._helpers import layer_context

    config = Fp8Config.from_config({"weight_strategy": strategy})
    with layer_context():
        layer = MergedColumnParallelLinear(64, [32, 32], bias=False, params_dtype=torch.half,
                                           quant_config=config)
    gate, up = torch.randn(32, 64), torch.randn(32, 64) * 4
    layer.weight.weight_loader(layer.weight, gate.half(), 0)
    layer.weight.weight_loader(layer.weight, up.half(), 1)
    layer.quant_method.process_weights_after_loading(layer)
    assert layer.weight.dtype == torch.float8_e4m3fn
    assert layer.weight_scale.shape == ((64,) if strategy == "channel" else (1,))
    dequantised = layer.quant_method.dequantize_weight(layer)
    full = torch.cat([gate, up]).half().float()
    step = layer.weight_scale.reshape(-1, 1) * 32            # e4m3 steps are <= max / 14
    assert ((dequantised - full).abs() <= step).all()
    x = torch.randn(3, 64).half()
    out = layer(x)[0]
    ref = fake_fp8_per_tensor(x.float()) @ dequantised.t()
    torch.testing.assert_close(out.float(), ref, rtol=2 ** -7, atol=2 ** -7 * ref.abs().max().item())
