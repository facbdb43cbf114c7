"""Online int4 (`quantization="int4"`): round-to-nearest per group after loading an unquantized
checkpoint; the whole model against transformers running the same dequantised weights."""

import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from minivllm.model_executor.layers.quantization import get_quantization_config
from minivllm.model_executor.layers.quantization import int4
from minivllm.model_executor.layers.quantization.int4 import Int4Config, quantize_int4

from tests.model_executor.layers.quantization._int4_checkpoints import (LINEARS, check_against_hf,
                                                                      model_of, prompts, run_llm)

CONFIG = dict(hidden_size=128, intermediate_size=256)   # every input size divides by 128


@pytest.mark.parametrize("sym", [False, True])
@pytest.mark.parametrize("group_size", [32, 128])
def test_quantize_int4_rounds_to_nearest(group_size: int, sym: bool):
    weight = torch.randn(96, 256)
    weight[:, :group_size] = 0.0                              # an all-zero group
    codes, scales, zero_points = quantize_int4(weight, group_size, sym)
    assert codes.dtype == torch.uint8 and int(codes.max()) <= 15
    assert scales.shape == zero_points.shape == (96, 256 // group_size)
    if sym:
        assert bool((zero_points == 8).all())
    # [N, K/g, g]: within half a step of the original, and the zero group exact
    deq = (codes.view(96, -1, group_size) - zero_points[..., None]) * scales[..., None]
    err = (deq - weight.view(96, -1, group_size)).abs()
    assert bool((err <= scales[..., None] * 0.5 + 1e-6).all())
    assert bool((deq[:, 0] == 0).all())


def test_quantize_int4_in_row_chunks_is_the_same(monkeypatch):
    weight = torch.randn(96, 256)
    whole = quantize_int4(weight, 64, False)
    monkeypatch.setattr(int4, "_QUANTIZE_CHUNK", 256 * 10)     # 10 rows at a time
    for a, b in zip(quantize_int4(weight, 64, False), whole):
        assert torch.equal(a, b)


def test_config_defaults_and_errors():
    assert get_quantization_config("int4") is Int4Config
    config = Int4Config.from_config({})
    assert (config.group_size, config.sym) == (None, False)   # per layer: 128, else 64, 32
    assert Int4Config.from_config({"group_size": 32, "sym": True}).sym
    with pytest.raises(ValueError, match="group_size 96 is not supported.*32, 64, 128"):
        Int4Config.from_config({"group_size": 96})
    with pytest.raises(ValueError, match="already quantized \\('awq'\\).*--quantization awq"):
        Int4Config.from_config({"quant_method": "awq", "bits": 4})


def _write_int4_reference(src: str, dst: str, group_size: int, sym: bool) -> str:
    """The checkpoint with each linear replaced by its int4 round trip (from the bf16 weights the
    engine loads), in fp32: what transformers should agree with."""
    state = load_file(os.path.join(src, "model.safetensors"))
    for name, weight in state.items():
        if name.removesuffix(".weight").endswith(LINEARS):
            codes, scales, zero_points = quantize_int4(weight.bfloat16(), group_size, sym)
            deq = (codes.view(weight.shape[0], -1, group_size) - zero_points[..., None]) \
                * scales[..., None]
            state[name] = deq.view(weight.shape).contiguous()
    os.makedirs(dst)
    save_file(state, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    for extra in ("config.json", "generation_config.json"):
        if os.path.exists(os.path.join(src, extra)):
            with open(os.path.join(src, extra)) as f, open(os.path.join(dst, extra), "w") as g:
                g.write(f.read())
    return dst


@pytest.mark.parametrize(("group_size", "sym"), [(128, False), (32, True)])
def test_online_int4_matches_transformers_on_its_dequantised_weights(
        tiny_llama_factory, tmp_path, group_size: int, sym: bool, monkeypatch):
    path = tiny_llama_factory("int4", **CONFIG)
    monkeypatch.setattr(Int4Config, "from_config", classmethod(
        lambda cls, config: cls(group_size=group_size, sym=sym)))
    ref_path = _write_int4_reference(path, str(tmp_path / "ref"), group_size, sym)
    llm = check_against_hf(path, ref_path, "bfloat16", atol=0.1, quantization="int4")
    layer = model_of(llm).model.layers[0].self_attn.qkv_proj
    # the repacked form replaced the dense weight: [N, K/2] codes, no bf16 copy left
    assert "weight" not in layer._parameters and layer.qweight.dtype == torch.uint8
    assert layer.qweight.shape == (256, 64) and layer.scales_and_zeros.dtype == torch.bfloat16


def test_online_int4_stays_close_to_the_bf16_model(tiny_llama_factory):
    path = tiny_llama_factory("int4", **CONFIG)
    prompt_ids = prompts()
    _, base = run_llm(path, prompt_ids)
    _, quant = run_llm(path, [ids + tokens for ids, (tokens, _) in zip(prompt_ids, base)],
                       quantization="int4")
    # The int4 model scores the bf16 model's tokens about as the bf16 model does: its ~10%
    # weight error moves this random tiny model's logprobs by a fraction of their spread.
    for (tokens, base_lp), (_, quant_lp) in zip(base, quant):
        quant_lp = quant_lp[:len(base_lp)]
        assert torch.corrcoef(torch.stack([base_lp, quant_lp]))[0, 1] > 0.9
        assert (quant_lp - base_lp).abs().mean() < 0.35 * base_lp.std()


@pytest.mark.requires_native                          # inductor compiles C++
def test_compiled_model_runs_the_int4_op_as_eager(tiny_llama_factory):
    path = tiny_llama_factory("int4", **CONFIG)
    _, eager = run_llm(path, prompts(), quantization="int4")
    _, compiled = run_llm(path, prompts(), quantization="int4", enforce_eager=False)
    for (eager_tokens, eager_lp), (tokens, lp) in zip(eager, compiled):
        assert tokens == eager_tokens
        torch.testing.assert_close(lp, eager_lp, atol=1e-3, rtol=0)


def test_default_group_is_the_largest_dividing_each_layer(tiny_llama_factory):
    # hidden 96: q/k/v/gate/up take groups of 32, o_proj too, down_proj (in 256) 128
    path = tiny_llama_factory("int4_h96", hidden_size=96, intermediate_size=256,
                              num_attention_heads=4, num_key_value_heads=2)
    llm, _ = run_llm(path, prompts(), quantization="int4")
    layer = model_of(llm).model.layers[0]
    assert layer.self_attn.qkv_proj.int4_group_size == 32
    assert layer.mlp.down_proj.int4_group_size == 128
